"""Start the router: the public gRPC API (and HTTP) on one port, the internal control plane on
another (cluster credentials required), and the reaper."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdcommon.config import ClusterConfig
from pdcommon.grpc_server import add_service, make_server
from pdcommon.security import ClusterIdentity
from pdcommon.token_stream import TokenInbox
from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import worker_pb2 as wpb
from router.auth import ApiKeyInterceptor, ApiKeys, load_api_keys
from router.autoscale import PlannerLoop
from router.core import RouterCore
from router.launcher import Launcher
from router.metrics import RouterMetrics
from router.planner import make_planner
from router.scaling import Scaler
from router.service import ControlService, RouterService

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(self, cfg: ClusterConfig, launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        # Refuses to construct without the secret its security mode needs (SecurityConfigError).
        self.identity = ClusterIdentity.from_config(cfg.security)
        self.core = RouterCore(cfg, launcher, identity=self.identity)
        self.scaler = Scaler(self.core)
        self.planner = PlannerLoop(self.core, self.scaler, make_planner(cfg), cfg.planner.interval_s) \
            if cfg.planner.mode != "static" else None
        self.metrics = RouterMetrics(self.core)
        self.keys = ApiKeys(load_api_keys(cfg.router.api_keys, cfg.router.api_keys_file), cfg.router.protect_probes)
        self._http = None
        self.server: grpc.aio.Server | None = None
        self.control: grpc.aio.Server | None = None
        self.address = ""
        self.control_address = ""
        self._reaper: asyncio.Task | None = None
        self.tokens: TokenInbox | None = None

    async def start(self) -> str:
        r = self.cfg.router
        if not self.keys.enabled and r.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("the public API on %s has no API keys: anyone who reaches it may use it (set "
                        "router.api_keys_file or PDSERVE_API_KEYS)", r.host)
        self.identity.warn_if_open("the router's control port")
        self.server = make_server(r.max_request_bytes, [ApiKeyInterceptor(self.keys)])
        add_service(self.server, RouterService(self.core), pb.DESCRIPTOR.services_by_name["Router"])
        port = self.server.add_insecure_port(f"{r.host}:{r.port}")
        if port == 0:
            raise OSError(f"router cannot bind {r.host}:{r.port}")
        self.control = make_server(r.max_request_bytes, self.identity.interceptors())
        add_service(self.control, ControlService(self.core, self.scaler), wpb.DESCRIPTOR.services_by_name["Control"])
        chost = r.control_host or r.host
        cport = self.identity.bind(self.control, f"{chost}:{r.control_port}")
        if cport == 0:
            raise OSError(f"router cannot bind its control port {chost}:{r.control_port}")
        if r.token_port is not None and self.identity.mode != "mtls":
            self.tokens = TokenInbox(chost, r.token_port)
            self.tokens.start()
            self.core.admission.tokens = self.tokens
        await self.server.start()
        await self.control.start()
        self.address = f"{r.advertise_host or r.host}:{port}"
        self.control_address = self.core.control_address = f"{r.advertise_host or chost}:{cport}"
        self._reaper = asyncio.create_task(self.core.members.reap_forever(self.cfg.heartbeat.interval_s / 4))
        if self.planner is not None:
            self.planner.start()
        if r.http_port is not None:
            await self._start_http(r.host, r.http_port, r.advertise_host)
        log.info("router serving on %s (HTTP %s; control plane on %s, security %s)", self.address,
                 self.core.http_address or "off", self.control_address, self.identity.mode)
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
        if self.planner is not None:
            await self.planner.stop()
        if self._http is not None:
            await self._http.cleanup()
        for server in (self.server, self.control):
            if server is not None:
                await server.stop(grace=1.0)
        if self.tokens is not None:
            self.tokens.close()


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
