"""Start the router: gRPC server with the public and control services, and the reaper."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdcommon.config import ClusterConfig
from pdcommon.grpc_server import add_service, make_server
from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import worker_pb2 as wpb
from router.auth import ApiKeyInterceptor, ApiKeys, load_api_keys
from router.core import RouterCore
from router.launcher import Launcher
from router.metrics import RouterMetrics
from router.scaling import Scaler
from router.service import ControlService, RouterService

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(self, cfg: ClusterConfig, launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        self.core = RouterCore(cfg, launcher)
        self.scaler = Scaler(self.core)
        self.metrics = RouterMetrics(self.core)
        self.keys = ApiKeys(load_api_keys(cfg.router.api_keys, cfg.router.api_keys_file), cfg.router.protect_probes)
        self._http = None
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._reaper: asyncio.Task | None = None

    async def start(self) -> str:
        r = self.cfg.router
        if not self.keys.enabled and r.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("the public API on %s has no API keys: anyone who reaches it may use it (set "
                        "router.api_keys_file or PDSERVE_API_KEYS)", r.host)
        self.server = make_server(r.max_request_bytes, [ApiKeyInterceptor(self.keys)])
        add_service(self.server, RouterService(self.core, self.scaler), pb.DESCRIPTOR.services_by_name["Router"])
        add_service(self.server, ControlService(self.core), wpb.DESCRIPTOR.services_by_name["Control"])
        r = self.cfg.router
        port = self.server.add_insecure_port(f"{r.host}:{r.port}")
        if port == 0:
            raise OSError(f"router cannot bind {r.host}:{r.port}")
        await self.server.start()
        self.address = f"{r.advertise_host or r.host}:{port}"
        self._reaper = asyncio.create_task(self.core.members.reap_forever(self.cfg.heartbeat.interval_s / 4))
        if r.http_port is not None:
            await self._start_http(r.host, r.http_port, r.advertise_host)
        log.info("router serving on %s (HTTP %s)", self.address, self.core.http_address or "off")
        return self.address

    async def _start_http(self, host: str, port: int, advertise: str | None) -> None:
        from aiohttp import web

        from router.http_api import OpenAIApi

        api = OpenAIApi(self.core, self.metrics, self.keys)
        # handler_cancellation: a client that disconnects cancels its handler, so a non-streaming
        # request stops generating too (aiohttp leaves handlers running by default).
        self._http = web.AppRunner(api.app, access_log=None, handler_cancellation=True)
        await self._http.setup()
        site = web.TCPSite(self._http, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        self.core.http_address = f"http://{advertise or host}:{bound}"

    async def wait_ready(self, counts: dict[str, int], timeout_s: float) -> None:
        """Until each pool has the given number of active workers."""
        members = self.core.members
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while any(len(members.active(role)) < n for role, n in counts.items()):
            if loop.time() > end:
                have = {role: len(members.active(role)) for role in counts}
                raise TimeoutError(f"workers did not register within {timeout_s:.0f}s: have {have}, want {counts}")
            await members.wait_changed(0.5)

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        if self._http is not None:
            await self._http.cleanup()
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
