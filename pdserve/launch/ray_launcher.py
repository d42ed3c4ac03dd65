"""The Launcher the router gets under Ray: workers are Ray actors it creates and kills.

Worker actors are detached and named `<cluster>-<worker id>`: they do not share the router
actor's fate, so a router that dies and is restarted by Ray finds them again (`adopt`) while
they keep serving and re-register with it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re

import ray

from pdcommon.config import ClusterConfig
from pdcommon.process_env import worker_process_env
from pdserve.launch.placement import actor_options
from pdserve.launch.roles import ROLES
from pdserve.launch.worker_actor import WorkerActor

log = logging.getLogger(__name__)


class RayLauncher:
    self_healing = False  # a dead actor stays dead: the router starts a replacement

    def __init__(self, cfg: ClusterConfig, cluster_name: str) -> None:
        self.cfg = cfg
        self._cfg_dump = cfg.model_dump()  # what worker actors receive
        self.cluster_name = cluster_name
        self.router_address = ""
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self._ids = {role: itertools.count() for role in ROLES}

    def _actor_name(self, worker_id: str) -> str:
        return f"{self.cluster_name}-{worker_id}"

    def adopt(self) -> list[str]:
        """Take over the live worker actors of this cluster (after a router restart)."""
        pattern = re.compile(rf"^{re.escape(self.cluster_name)}-((\w+)-(\d+))$")
        top = {role: -1 for role in ROLES}
        for name in ray.util.list_named_actors():
            m = pattern.match(name)
            if m is None or m.group(2) not in top:
                continue
            try:
                self.actors[m.group(1)] = ray.get_actor(name)
            except ValueError:  # gone between the listing and the lookup
                continue
            top[m.group(2)] = max(top[m.group(2)], int(m.group(3)))
        self._ids = {role: itertools.count(top[role] + 1) for role in ROLES}
        return sorted(self.actors)

    async def add_worker(self, role: str) -> str:
        worker_id = f"{role}-{next(self._ids[role])}"
        # Ray starts a fresh worker process for a runtime_env: these are set from its first instruction.
        env = {"env_vars": worker_process_env(self.cfg, role)}
        actor = WorkerActor.options(name=self._actor_name(worker_id), lifetime="detached", runtime_env=env,
                                    **actor_options(self.cfg.pool(role).resources)).remote(
            self._cfg_dump, role, worker_id, self.router_address)
        self.actors[worker_id] = actor
        return worker_id

    async def remove_worker(self, worker_id: str, role: str) -> None:
        actor = self.actors.pop(worker_id, None)
        if actor is None:
            return
        try:
            await asyncio.wait_for(actor.shutdown.remote(), 15)
        except Exception as e:  # already dead or stuck: kill it regardless
            log.info("shutdown of %s: %r", worker_id, e)
        ray.kill(actor, no_restart=True)

    async def remove_all(self) -> None:
        await asyncio.gather(*(self.remove_worker(w, "") for w in list(self.actors)), return_exceptions=True)

    async def pids(self) -> dict[str, int]:
        out = {}
        for wid, actor in list(self.actors.items()):
            try:
                out[wid] = await asyncio.wait_for(actor.pid.remote(), 30)
            except Exception:
                continue
        return out
