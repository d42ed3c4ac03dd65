"""A whole cluster in one process: the real router and workers (gRPC servers, ZeroMQ sockets,
engine threads) on one background event loop, each bound to its own address. For tests,
benchmarks and single-machine use without Ray."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path

from pdcommon.client import ControlClient, RouterClient
from pdcommon.config import ClusterConfig
from pdcommon.event_loop import new_event_loop
from pdcommon.security import ClusterIdentity, provision_token, remove_secret
from pdcommon.worker_runtime import WorkerRuntime
from pdserve.launch.roles import serve_worker
from router import RouterServer


class InProcessCluster:
    def __init__(self, cfg: ClusterConfig, counts: dict[str, int] | None = None) -> None:
        self.cfg = cfg
        self.counts = counts or {role: cfg.pool(role).replicas for role in cfg.roles}
        self.loop = new_event_loop(cfg.process.event_loop)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.router: RouterServer | None = None
        self.address = ""
        self.stop_event: asyncio.Event | None = None
        self.tasks: list[asyncio.Task] = []
        self._secret: Path | None = None

    def _run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> InProcessCluster:
        sec = self.cfg.security
        if sec.mode == "token" and not sec.token_file:  # a directory only for a token to write (removed with it)
            self._secret = provision_token(sec, Path(tempfile.mkdtemp(prefix="pdserve-")) / "token")
        self.thread.start()

        async def up() -> str:
            self.stop_event = asyncio.Event()
            self.router = RouterServer(self.cfg)
            addr = await self.router.start()
            for role, n in self.counts.items():
                for i in range(n):
                    self.tasks.append(asyncio.create_task(
                        serve_worker(self.cfg, role, f"{role}-{i}", self.router.control_address, self.stop_event)))
            await self.router.wait_ready(self.counts, 120)
            return addr

        self.address = self._run(up())
        return self

    @property
    def core(self):
        return self.router.core

    def runtimes(self) -> list:
        return [rt for rt in WorkerRuntime.instances if rt.cfg is self.cfg]

    def client(self) -> RouterClient:
        return RouterClient(self.address)

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Every worker's pool back to zero referenced blocks and no live sequence."""
        end = time.monotonic() + timeout
        while True:
            busy = [(rt.worker_id, rt.engine.bm.num_used_blocks, len(rt.engine.seqs)) for rt in self.runtimes()
                    if rt.engine is not None and (rt.engine.bm.num_used_blocks or rt.engine.seqs)]
            if not busy:
                return
            if time.monotonic() > end:
                raise AssertionError(f"workers still hold blocks or sequences: {busy}")
            time.sleep(0.05)

    def stop(self) -> None:
        async def down() -> None:
            self.stop_event.set()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.router.stop()

        try:
            self._run(down(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            remove_secret(self._secret)

    def control_client(self) -> ControlClient:
        """The internal control plane (Scale), with this cluster's own credentials."""
        return ControlClient(self.router.control_address, ClusterIdentity.from_config(self.cfg.security))

    def __enter__(self) -> InProcessCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
