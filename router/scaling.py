"""Growing and shrinking pools while serving. The router decides who leaves and drains them
(no new requests; live ones finish); the launcher starts and stops the processes."""

from __future__ import annotations

import asyncio
import logging

import grpc

from router.core import RouterCore
from router.request import RequestFailed

log = logging.getLogger(__name__)


class Scaler:
    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.adding: dict[str, int] = {role: 0 for role in core.cfg.roles}
        self._tasks: set[asyncio.Task] = set()
        core.members.on_leave.append(self._on_leave)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_leave(self, rec, why: str) -> None:
        launcher = self.core.launcher
        if why != "drained" and launcher is not None and not launcher.self_healing:
            self._spawn(self._replace(rec.worker_id, rec.role))

    async def _replace(self, worker_id: str, role: str) -> None:
        """Self-healing: a worker declared dead gets `replace_after_s` to come back (a SIGSTOPped
        one that resumes re-registers); after that it is stopped and a new one started if the pool
        is below its target."""
        core = self.core
        await asyncio.sleep(core.cfg.router.replace_after_s)
        if worker_id in core.members.workers or self.current(role) >= core.targets.get(role, 0):
            return
        try:
            await core.launcher.remove_worker(worker_id, role)
        except Exception:
            log.exception("launcher failed to stop %s", worker_id)
        self.adding[role] += 1
        try:
            new_id = await core.launcher.add_worker(role)
            log.warning("replaced a dead worker", extra={"worker_id": worker_id, "replacement": new_id})
        except Exception:
            log.exception("launcher failed to replace %s", worker_id)
        finally:
            self.adding[role] -= 1

    def current(self, pool: str) -> int:
        return len(self.core.members.active(pool)) + self.adding[pool]

    async def scale(self, pool: str, replicas: int) -> tuple[int, list[str], list[str]]:
        core = self.core
        if pool not in core.cfg.roles:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"pool must be one of {list(core.cfg.roles)} in {core.cfg.mode} mode, got {pool!r}")
        if core.launcher is None:
            raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                "this router has no launcher to start or stop workers; start or stop worker processes "
                                "yourself (for example `kubectl scale`) or run the cluster with `pdserve up`")
        if replicas < 1:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "a pool needs at least one replica")
        prev = self.current(pool)
        core.targets[pool] = replicas
        adding: list[str] = []
        draining: list[str] = []
        if replicas > prev:
            self.adding[pool] += replicas - prev
            try:
                adding = list(await asyncio.gather(*(core.launcher.add_worker(pool) for _ in range(replicas - prev))))
            finally:
                self.adding[pool] -= replicas - prev
        elif replicas < prev:
            active = sorted(core.members.active(pool), key=lambda w: (w.load, w.worker_id))
            for w in active[: prev - replicas]:
                w.state = "draining"
                draining.append(w.worker_id)
                self._spawn(self._retire(w.worker_id, pool))
        log.info("scale %s: %d -> %d (adding %s, draining %s)", pool, prev, replicas, adding, draining)
        return prev, adding, draining

    async def _retire(self, worker_id: str, role: str) -> None:
        members = self.core.members
        while True:
            rec = members.workers.get(worker_id)
            if rec is None:
                return
            if not rec.inflight:
                break
            await members.wait_changed(0.5)
        members.retire(worker_id)
        try:
            await self.core.launcher.remove_worker(worker_id, role)
        except Exception:
            log.exception("launcher failed to remove %s", worker_id)
