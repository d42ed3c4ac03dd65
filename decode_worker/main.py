"""Run one decode worker (or a colocated one: the same service, prefilling locally) until stopped."""

from __future__ import annotations

import asyncio

from decode_worker.service import DecodeService, add_to_server
from pdcommon.config import ClusterConfig
from pdcommon.worker_runtime import WorkerRuntime
from transfer import make_receiver


async def serve(cfg: ClusterConfig, worker_id: str, router_address: str, stop: asyncio.Event | None = None,
                started: asyncio.Future | None = None, role: str = "decode") -> None:
    rt = WorkerRuntime(cfg, role, worker_id, router_address)
    pool = cfg.pool(role)
    service = DecodeService(rt)
    if role == "decode":  # colocated workers compute their own KV: nothing arrives
        t = cfg.transfer
        receiver = make_receiver(t.transport, host=pool.host, port=pool.transfer_port,
                                 advertise_host=pool.advertise_host, sink=service, partial_timeout_s=t.timeout_s,
                                 max_frame_bytes=t.max_frame_bytes, keys=service.transfer_key, curve=t.curve,
                                 max_per_peer=t.max_transfers_per_peer, shared_memory=t.shared_memory,
                                 server_credentials=rt.identity.transfer_credentials().get("server_credentials"))
        rt.transfer_address = receiver.address
        rt.transfer_public_key = getattr(receiver, "public_key", "")
        service.attach(receiver)
    rt.service = service
    try:
        await rt.run(lambda server: add_to_server(server, service), stop, started)
    finally:
        service.close()
