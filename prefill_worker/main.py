"""Run one prefill worker until stopped."""

from __future__ import annotations

import asyncio

from pdcommon.config import ClusterConfig
from pdcommon.worker_runtime import WorkerRuntime
from prefill_worker.service import PrefillService, add_to_server
from transfer import make_sender


async def serve(cfg: ClusterConfig, worker_id: str, router_address: str, stop: asyncio.Event | None = None,
                started: asyncio.Future | None = None) -> None:
    rt = WorkerRuntime(cfg, "prefill", worker_id, router_address)
    tls = rt.identity.transfer_credentials()  # used by the gRPC transport only
    sender = make_sender(cfg.transfer.transport, curve=cfg.transfer.curve,
                         channel_credentials=tls.get("channel_credentials"), channel_options=tls.get("channel_options"))
    service = PrefillService(rt, sender)
    rt.service = service

    def add(server) -> None:  # the engine is up: its KV pool may be offered before any request
        memory = rt.engine.shared_kv_memory()
        if memory is not None:
            sender.share(*memory)
        add_to_server(server, service)

    try:
        await rt.run(add, stop, started)
    finally:
        service.close()
        sender.close()
