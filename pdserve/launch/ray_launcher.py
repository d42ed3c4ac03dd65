"""The Launcher the router gets under Ray: workers are Ray actors it creates and kills."""

from __future__ import annotations

import asyncio
import itertools
import logging

import ray

from pdserve.launch.worker_actor import WorkerActor

log = logging.getLogger(__name__)


class RayLauncher:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.router_address = ""
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self._ids = {role: itertools.count() for role in ("prefill", "decode", "colocated")}

    async def add_worker(self, role: str) -> str:
        worker_id = f"{role}-{next(self._ids[role])}"
        threads = str(self.cfg.get("engine", {}).get("num_threads") or 1)
        env = {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}}
        actor = WorkerActor.options(name=f"pdserve-{worker_id}-{id(self)}", runtime_env=env).remote(
            self.cfg, role, worker_id, self.router_address)
        self.actors[worker_id] = actor
        return worker_id

    async def remove_worker(self, worker_id: str) -> None:
        actor = self.actors.pop(worker_id, None)
        if actor is None:
            return
        try:
            await asyncio.wait_for(actor.shutdown.remote(), 15)
        except Exception as e:  # already dead or stuck: kill it regardless
            log.info("shutdown of %s: %r", worker_id, e)
        ray.kill(actor, no_restart=True)

    async def remove_all(self) -> None:
        await asyncio.gather(*(self.remove_worker(w) for w in list(self.actors)), return_exceptions=True)

    async def pids(self) -> dict[str, int]:
        out = {}
        for wid, actor in list(self.actors.items()):
            try:
                out[wid] = await asyncio.wait_for(actor.pid.remote(), 30)
            except Exception:
                continue
        return out
