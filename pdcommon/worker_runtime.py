"""What both worker pools share: building the engine, the gRPC server, registration with the
router and heartbeats (the same under Ray and Kubernetes)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import ClassVar

import grpc

from engine import LLMEngine
from engine.model_meta import fingerprint, resolve_model_path
from pdcommon.config import ClusterConfig
from pdcommon.convert import layout_to_proto, stats_to_proto
from pdcommon.engine_loop import EngineLoop
from pdcommon.gc_heap import frozen_objects
from pdcommon.grpc_server import make_server
from pdcommon.security import ClusterIdentity
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc

log = logging.getLogger(__name__)


class WorkerRuntime:
    instances: ClassVar[weakref.WeakSet[WorkerRuntime]] = weakref.WeakSet()  # live ones, for introspection

    def __init__(self, cfg: ClusterConfig, role: str, worker_id: str, router_address: str) -> None:
        """`router_address`: the router's control port (router.control_port), not its public one."""
        self.cfg, self.role, self.worker_id, self.router_address = cfg, role, worker_id, router_address
        # Refuses to construct without the secret its security mode needs (SecurityConfigError).
        self.identity = ClusterIdentity.from_config(cfg.security)
        self.pool = cfg.pool(role)
        self.engine: LLMEngine | None = None
        self.loop_: EngineLoop | None = None
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.transfer_address = ""
        self.transfer_public_key = ""  # the KV receiver's CURVE key, when KV is encrypted
        self.inflight = 0
        self.served = 0
        self.reserved_blocks = 0
        self.state = "active"
        self.service: object | None = None  # the role's gRPC servicer, for introspection
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._died = asyncio.Event()  # set by _engine_died
        self._hb_wake = threading.Event()  # a heartbeat now (the drain tells the router at once)
        self._drain_seen = threading.Event()  # the router knows this worker is draining (or forgot it)
        self.registered = False
        self._orphans = 0
        self._fingerprint: str | None = None
        self.incarnation = uuid.uuid4().hex  # this process's life: a restart gets a new one
        WorkerRuntime.instances.add(self)

    @property
    def engine_loop(self) -> EngineLoop:
        assert self.loop_ is not None
        return self.loop_

    async def start(self, add_servicer: Callable[[grpc.aio.Server], None]) -> None:
        loop = asyncio.get_running_loop()
        ecfg = self.cfg.engine_config(self.role)
        # Built on the engine thread, which then steps it (see pdcommon/engine_loop.py); the event
        # loop stays free while it loads.
        self.loop_ = EngineLoop(lambda: LLMEngine(ecfg), loop)
        self.loop_.on_death = self._engine_died
        self.engine = await self.loop_.ready
        self.server = make_server(self.cfg.router.max_request_bytes, self.identity.interceptors())
        add_servicer(self.server)
        port = self.identity.bind(self.server, f"{self.pool.host}:{self.pool.port}")
        if port == 0:
            raise OSError(f"{self.role} worker cannot bind {self.pool.host}:{self.pool.port}")
        self.identity.warn_if_open(f"{self.role} worker {self.worker_id}")
        await self.server.start()
        self.address = f"{self.pool.advertise_host or self.pool.host}:{port}"
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._hb_thread.start()
        log.info("%s worker %s serving on %s", self.role, self.worker_id, self.address)

    def status(self):
        """A snapshot for the heartbeat (any thread): nothing here waits on the engine."""
        st = self.engine_loop.stats
        # Counted on the engine thread between steps; the heartbeat sends the last count it has.
        self.engine_loop.submit(self._count_orphans)
        gauges = self.service.gauges() if hasattr(self.service, "gauges") else {}
        return stats_to_proto(self.worker_id, self.role, self.address, self.state, st, inflight=self.inflight,
                              requests_served=self.served, reserved_blocks=self.reserved_blocks,
                              orphan_blocks=self._orphans, open_fds=_open_fds(), rss_bytes=_rss_bytes(),
                              gc_frozen_objects=frozen_objects(), **gauges)

    def _count_orphans(self) -> None:
        self._orphans = max(self.engine.orphan_refs(), 0)

    def info(self) -> wpb.WorkerInfo:
        assert self.engine is not None
        path = resolve_model_path(self.cfg.model)
        if self._fingerprint is None:
            self._fingerprint = fingerprint(path)
        return wpb.WorkerInfo(worker_id=self.worker_id, role=self.role, address=self.address,
                              transfer_address=self.transfer_address, num_blocks=self.engine.bm.num_blocks,
                              block_size=self.engine.bm.block_size, model=path.name,
                              model_fingerprint=self._fingerprint, kv_layout=layout_to_proto(self.engine.kv_layout),
                              incarnation=self.incarnation, transfer_public_key=self.transfer_public_key)

    def _heartbeat_loop(self) -> None:
        """Register, then heartbeat every interval, on a thread of its own with a blocking stub: a
        long engine step or a worker event loop busy with a burst of streams cannot delay it.

        A failed call (router busy or restarting) is retried as a heartbeat: only a router that no
        longer knows this worker gets a new registration, so a slow router never makes a live
        worker look like a new one."""
        interval = self.cfg.heartbeat.interval_s
        timeout = max(interval, 2.0)
        registered = False
        md = self.identity.metadata
        with self.identity.channel(self.router_address) as channel:
            stub = wrpc.ControlStub(channel)
            while not self._hb_stop.is_set():
                t0 = time.monotonic()
                try:
                    if not registered and self.state == "draining":
                        # Drained and forgotten (a scale-down, or our own SIGTERM): going away, so
                        # never back into the pool, where new work would find a dying worker.
                        self._drain_seen.set()
                    elif not registered:
                        reply = stub.Register(self.info(), timeout=timeout, metadata=md)
                        registered = reply.accepted
                        if not reply.accepted:
                            log.error("router refused %s: %s", self.worker_id, reply.message)
                    if registered:
                        req = wpb.HeartbeatRequest(worker_id=self.worker_id, status=self.status(),
                                                   incarnation=self.incarnation)
                        hb = stub.Heartbeat(req, timeout=timeout, metadata=md)
                        registered = hb.known
                        if hb.drain:
                            self.state = "draining"
                        if req.status.state == "draining" and (hb.drain or not hb.known):
                            self._drain_seen.set()
                except grpc.RpcError as e:
                    # A router that refuses our credentials will not change its mind: say so loudly.
                    level = logging.ERROR if e.code() == grpc.StatusCode.UNAUTHENTICATED else logging.DEBUG
                    log.log(level, "heartbeat to %s failed: %s %s", self.router_address, e.code(), e.details())
                self._set_registered(registered)
                self._hb_wake.wait(max(interval - (time.monotonic() - t0), 0.01))
                self._hb_wake.clear()

    def _engine_died(self) -> None:
        """The engine thread stopped on an error (its streams fail UNAVAILABLE, so the router drops
        this worker and retries them elsewhere). Heartbeats stop, so it is not taken back, and `run`
        ends: the process exits, or its launcher replaces it."""
        log.error("%s worker %s: engine stopped, leaving service", self.role, self.worker_id)
        self.state = "failed"
        self._hb_stop.set()
        self._hb_wake.set()
        self._died.set()

    async def run(self, add_servicer: Callable[[grpc.aio.Server], None], stop: asyncio.Event | None = None,
                  started: asyncio.Future | None = None) -> None:
        """Start, report the address through `started`, serve until `stop` is set, then stop.
        Raises EngineDead if the engine stops on an error first."""
        try:
            await self.start(add_servicer)
            if started is not None and not started.done():
                started.set_result(self.address)
            stopping = asyncio.ensure_future((stop or asyncio.Event()).wait())
            dying = asyncio.ensure_future(self._died.wait())
            await asyncio.wait({stopping, dying}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            dying.cancel()
            if self._died.is_set():
                raise self.engine_loop.dead_error()
            await self.drain(self.cfg.process.drain_timeout_s)
        finally:
            await self.stop()

    def _set_registered(self, registered: bool) -> None:
        """Track registration, and keep the readiness file in step: present while registered and active."""
        self.registered = registered
        path = self.cfg.process.ready_file
        if not path:
            return
        path = path.replace("{worker_id}", self.worker_id)
        try:
            if registered and self.state == "active":
                if not os.path.exists(path):
                    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # /tmp/pdserve on an emptyDir
                    with open(path, "w") as f:
                        f.write(self.worker_id + "\n")
            elif os.path.exists(path):
                os.unlink(path)
        except OSError as e:
            log.warning("cannot update the ready file %s: %s", path, e)

    async def drain(self, timeout_s: float) -> int:
        """Stop taking work, let what is in flight finish (up to timeout_s), then leave the router.
        Returns how many requests were still running when time ran out (0: a clean drain)."""
        loop = asyncio.get_running_loop()
        if self.server is None:  # never started
            return 0
        self.state = "draining"
        # Warnings, not info: a pod's lifecycle should show in its log at the default level.
        log.warning("%s worker %s draining: %d requests in flight, up to %.0fs", self.role, self.worker_id,
                    self.inflight, timeout_s)
        if self.registered:
            self._hb_wake.set()
            # The router stops routing here once a heartbeat says so: wait for that (briefly; a
            # router that is gone cannot be told).
            await loop.run_in_executor(None, self._drain_seen.wait, min(timeout_s, 2 * self.cfg.heartbeat.interval_s
                                                                          + 1.0))
        end = time.monotonic() + timeout_s
        while self.inflight > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        left = max(self.inflight, 0)
        log.warning("%s worker %s drained (%d requests unfinished)", self.role, self.worker_id, left)
        self._hb_stop.set()
        self._hb_wake.set()
        if self._hb_thread is not None:
            await loop.run_in_executor(None, self._hb_thread.join, 5)
        if self.registered:
            await loop.run_in_executor(None, self._leave, left)
        return left

    def _leave(self, unfinished: int) -> None:
        try:
            with self.identity.channel(self.router_address) as channel:
                wrpc.ControlStub(channel).Leave(wpb.LeaveRequest(worker_id=self.worker_id, incarnation=self.incarnation,
                                                                 unfinished=unfinished),
                                                timeout=2.0, metadata=self.identity.metadata)
        except grpc.RpcError as e:  # the router is gone too: it drops us by heartbeat timeout anyway
            log.info("leaving the router failed: %s %s", e.code(), e.details())

    async def stop(self) -> None:
        self._hb_stop.set()
        self._hb_wake.set()
        self._set_registered(False)
        if self._hb_thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._hb_thread.join, 5)
        if self.server:
            await self.server.stop(grace=0.5)
        if self.loop_:
            self.loop_.stop()


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return 0


def _rss_bytes() -> int:
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
