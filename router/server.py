"""Start the router: gRPC server with the public and control services, and the reaper."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.config import ClusterConfig
from pdserve.v1 import router_pb2_grpc as rrpc
from pdserve.v1 import worker_pb2_grpc as wrpc
from router.core import RouterCore
from router.launcher import Launcher
from router.scaling import Scaler
from router.service import ControlService, RouterService

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(self, cfg: ClusterConfig, launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        self.core = RouterCore(cfg, launcher)
        self.scaler = Scaler(self.core)
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._reaper: asyncio.Task | None = None

    async def start(self) -> str:
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        rrpc.add_RouterServicer_to_server(RouterService(self.core, self.scaler), self.server)
        wrpc.add_ControlServicer_to_server(ControlService(self.core), self.server)
        r = self.cfg.router
        port = self.server.add_insecure_port(f"{r.host}:{r.port}")
        if port == 0:
            raise OSError(f"router cannot bind {r.host}:{r.port}")
        await self.server.start()
        self.address = f"{r.advertise_host or r.host}:{port}"
        self._reaper = asyncio.create_task(self.core.members.reap_forever(self.cfg.heartbeat.interval_s / 4))
        log.info("router serving on %s", self.address)
        return self.address

    async def wait_ready(self, prefill: int, decode: int, timeout_s: float) -> None:
        members = self.core.members
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while len(members.active("prefill")) < prefill or len(members.active("decode")) < decode:
            if loop.time() > end:
                raise TimeoutError(f"workers did not register within {timeout_s:.0f}s "
                                   f"({len(members.active('prefill'))}/{prefill} prefill, "
                                   f"{len(members.active('decode'))}/{decode} decode)")
            members.changed.clear()
            try:
                await asyncio.wait_for(members.changed.wait(), 0.5)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        if self.server:
            await self.server.stop(grace=1.0)


async def serve(cfg: ClusterConfig, launcher: Launcher | None = None, stop: asyncio.Event | None = None,
                started: asyncio.Future | None = None) -> None:
    server = RouterServer(cfg, launcher)
    try:
        addr = await server.start()
        if started is not None and not started.done():
            started.set_result(addr)
        await (stop or asyncio.Event()).wait()
    finally:
        await server.stop()
