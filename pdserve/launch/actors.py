"""Ray actors that host the router and the workers. Each runs its asyncio server in a
background thread so the actor can still answer control calls (ready, pid, shutdown)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Coroutine

import ray

from pdserve.config import ClusterConfig


class _LoopHost:
    """Runs one async serve() in a thread; `started` gets its address."""

    def __init__(self, make: Callable[[asyncio.Event, asyncio.Future], Coroutine]) -> None:
        self._ready = threading.Event()
        self._address = ""
        self._error: BaseException | None = None
        self._make = make
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            started = self.loop.create_future()
            started.add_done_callback(self._on_started)
            try:
                await self._make(self.stop_event, started)
            except BaseException as e:
                self._error = e
                self._ready.set()
                raise

        try:
            asyncio.run(main())
        except BaseException:
            logging.getLogger(__name__).exception("server thread ended with an error")

    def _on_started(self, fut: asyncio.Future) -> None:
        self._address = fut.result()
        self._ready.set()

    def wait(self, timeout_s: float) -> str:
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"server did not start within {timeout_s:.0f}s")
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error!r}") from self._error
        return self._address

    def stop(self) -> None:
        if self.loop is not None and self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout=10)


def _quiet_logging() -> None:
    from pdserve.runtime.logs import setup_logging

    setup_logging()


@ray.remote(num_cpus=0, max_restarts=0)
class WorkerActor:
    def __init__(self, cfg: dict, role: str, worker_id: str, router_address: str) -> None:
        _quiet_logging()
        config = ClusterConfig.model_validate(cfg)
        if config.engine.num_threads:
            import torch

            torch.set_num_threads(config.engine.num_threads)
        if role == "prefill":
            from prefill_worker import serve
        elif role == "decode":
            from decode_worker import serve
        else:
            from decode_worker.colocated import serve
        self.worker_id = worker_id
        self.host = _LoopHost(lambda stop, started: serve(config, worker_id, router_address, stop, started))

    def ready(self, timeout_s: float = 300.0) -> str:
        return self.host.wait(timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.host.stop()


@ray.remote(num_cpus=0, max_restarts=0)
class RouterActor:
    def __init__(self, cfg: dict) -> None:
        _quiet_logging()
        from pdserve.launch.ray_launcher import RayLauncher
        from router import RouterServer

        self.cfg = ClusterConfig.model_validate(cfg)
        self.launcher = RayLauncher(cfg)
        self.server: RouterServer | None = None

        async def serve(stop: asyncio.Event, started: asyncio.Future) -> None:
            self.server = RouterServer(self.cfg, self.launcher)
            try:
                addr = await self.server.start()
                self.launcher.router_address = addr
                started.set_result(addr)
                await stop.wait()
            finally:
                await self.launcher.remove_all()
                await self.server.stop()

        self.host = _LoopHost(serve)

    def address(self, timeout_s: float = 120.0) -> str:
        return self.host.wait(timeout_s)

    def http_address(self) -> str:
        return self.server.core.http_address if self.server else ""

    def _run(self, coro, timeout_s: float):
        assert self.host.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.host.loop).result(timeout_s)

    def start_pools(self, counts: dict[str, int], timeout_s: float = 300.0) -> dict[str, list[str]]:
        """Launch the initial workers through the router's own launcher, wait until registered."""

        async def go() -> dict[str, list[str]]:
            ids: dict[str, list[str]] = {role: [] for role in counts}
            for role, n in counts.items():
                for _ in range(n):
                    ids[role].append(await self.launcher.add_worker(role))
            await self.server.wait_ready(counts, timeout_s)
            return ids

        return self._run(go(), timeout_s + 10)

    def worker_pids(self) -> dict[str, int]:
        return self._run(self.launcher.pids(), 60)

    def shutdown(self) -> None:
        self.host.stop()
