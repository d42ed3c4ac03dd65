"""The Ray actor that hosts the router; it starts and stops worker actors through RayLauncher."""

from __future__ import annotations

import asyncio

import ray

from pdcommon.config import ClusterConfig
from pdcommon.priority import restore_priority
from pdserve.launch.loop_host import LoopHost, quiet_logging
from pdserve.launch.placement import advertise_node_ip
from pdserve.launch.ray_launcher import RayLauncher


# Ray restarts a router that dies (max_restarts=-1): it binds the same ports (RayCluster fixes
# them before the first start) and adopts the worker actors, which outlive it and re-register.
@ray.remote(num_cpus=0, max_restarts=-1)
class RouterActor:
    def __init__(self, cfg: dict, cluster_name: str) -> None:
        quiet_logging()
        from router import RouterServer

        self.cfg = ClusterConfig.model_validate(cfg)
        advertise_node_ip(self.cfg, "router")
        restore_priority(self.cfg.process.nice)  # before any thread starts: they inherit it
        self.launcher = RayLauncher(self.cfg, cluster_name)
        if self.cfg.router.control_port:  # fixed before the first start (RayCluster): workers can start loading now
            self.launcher.router_address = self.cfg.router.control_target
        self.restarted = bool(self.launcher.adopt())
        self.server: RouterServer | None = None

        async def serve(stop: asyncio.Event, started: asyncio.Future) -> None:
            self.server = RouterServer(self.cfg, self.launcher)
            try:
                addr = await self.server.start()
                self.launcher.router_address = self.server.control_address  # workers talk to the control port
                started.set_result(addr)
                await stop.wait()
            finally:
                await self.launcher.remove_all()
                await self.server.stop()

        self.host = LoopHost(serve, self.cfg.process.io_nice, self.cfg.process.event_loop, freeze_heap=True,
                             slice_us=self.cfg.process.serving_slice_us)

    def address(self, timeout_s: float = 120.0) -> str:
        return self.host.wait(timeout_s)

    def http_address(self) -> str:
        return self.server.core.http_address if self.server else ""

    def control_address(self) -> str:
        return self.server.control_address if self.server else ""

    def _run(self, coro, timeout_s: float):
        loop = self.host.wait_loop(timeout_s)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    def start_pools(self, counts: dict[str, int], timeout_s: float = 300.0) -> dict[str, list[str]]:
        """Launch the initial workers through the router's own launcher, wait until registered.
        Callable before the router has started: where its control address is known in advance,
        the workers start at once (their imports and model loading overlap the router's start,
        ~1 s of `pdserve up`) and register as soon as it listens."""

        async def go() -> dict[str, list[str]]:
            assert self.host.started is not None
            if not self.launcher.router_address:
                await asyncio.shield(self.host.started)
            ids: dict[str, list[str]] = {role: [] for role in counts}
            for role, n in counts.items():
                for _ in range(n):
                    ids[role].append(await self.launcher.add_worker(role))
            await asyncio.shield(self.host.started)  # raises if the router failed to start
            assert self.server is not None
            await self.server.wait_ready(counts, timeout_s)
            return ids

        return self._run(go(), timeout_s + 10)

    def worker_pids(self) -> dict[str, int]:
        return self._run(self.launcher.pids(), 60)

    def pid(self) -> int:
        import os

        return os.getpid()

    def shutdown(self) -> None:
        self.host.stop()
