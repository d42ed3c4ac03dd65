"""`pdserve up` on one host (the default, or `--launcher process`): no Ray. The router runs in the `pdserve up`
process and each worker is a child process (`pdserve prefill|decode|colocated`), as vLLM and
SGLang run a single node.

Why: on a small machine Ray's own start is most of `pdserve up` (ray.init ~5.5 s here, then ~1.4 s
to boot each actor's process), and its daemons keep a share of the cores. What is lost: Ray's
placement over several hosts and its restart of a dead router; a dead worker is still replaced
by the router, through this launcher, as under Ray."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import subprocess
import sys

import yaml

from pdcommon.config import ClusterConfig
from pdcommon.process_env import worker_process_env
from pdcommon.security import TOKEN_ENV
from pdserve.launch.roles import ROLES

log = logging.getLogger(__name__)


class ProcessLauncher:
    self_healing = False  # a dead child stays dead: the router starts a replacement

    def __init__(self, cfg: ClusterConfig, router_address: str) -> None:
        self.cfg = cfg
        self.router_address = router_address
        self.procs: dict[str, subprocess.Popen] = {}
        self._ids = {role: itertools.count() for role in ROLES}
        # The workers read the config as resolved here (CLI overrides, ports, the token file); the
        # token budget a profile chose is already in it, so the profile is not resolved again.
        # It reaches them on standard input: no file to leave behind if `up` is killed.
        dump = cfg.model_dump(mode="json")
        dump["scheduling"] = {}
        self.config_yaml = yaml.safe_dump(dump)

    async def add_worker(self, role: str) -> str:
        worker_id = f"{role}-{next(self._ids[role])}"
        own = worker_process_env(self.cfg, role)
        # Set from the process's first instruction (glibc reads its tunables only then): no re-exec.
        env = {**os.environ, **own, "PDSERVE_REEXEC": "1", "PDSERVE_PARENT_PID": str(os.getpid())}
        env.pop(TOKEN_ENV, None)  # they read the token file up made: the secret stays out of their environment
        cmd = [sys.executable, "-m", "pdserve.cli", role, "--config", "-", "--router", self.router_address,
               "--worker-id", worker_id]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stdin=subprocess.PIPE, text=True)
        with proc.stdin:  # a few KB: the pipe takes it whole, whether or not the child reads yet
            proc.stdin.write(self.config_yaml)
        self.procs[worker_id] = proc
        return worker_id

    async def remove_worker(self, worker_id: str, role: str) -> None:
        proc = self.procs.pop(worker_id, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # drains what it holds, leaves the router, exits
        try:
            await asyncio.to_thread(proc.wait, self.cfg.process.drain_timeout_s + 10)
        except subprocess.TimeoutExpired:
            log.warning("worker %s did not exit after SIGTERM: killing it", worker_id)
            proc.kill()
            await asyncio.to_thread(proc.wait)

    async def remove_all(self) -> None:
        await asyncio.gather(*(self.remove_worker(w, "") for w in list(self.procs)), return_exceptions=True)

    async def pids(self) -> dict[str, int]:
        return {wid: p.pid for wid, p in self.procs.items() if p.poll() is None}


def die_with_parent() -> None:
    """In a worker started by ProcessLauncher: exit (SIGTERM: a drain) when `pdserve up` dies, even
    by SIGKILL, so no worker outlives its cluster."""
    parent = os.environ.get("PDSERVE_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


async def run_local(cfg: ClusterConfig, stop: asyncio.Event, on_ready) -> None:
    """Serve the router here, start the pools as child processes, call on_ready(server) once
    every pool has its workers, serve until `stop`, then drain and stop the workers. The router's
    ports must be pinned (cluster.pin_ports): the workers are told where it is before it listens."""
    from router import RouterServer

    launcher = ProcessLauncher(cfg, cfg.router.control_target)
    server = RouterServer(cfg, launcher)
    try:
        counts = {role: cfg.pool(role).replicas for role in cfg.roles}
        for role, n in counts.items():  # first: their imports overlap the router's start
            for _ in range(n):
                await launcher.add_worker(role)
        await server.start()
        launcher.router_address = server.control_address
        await server.wait_ready(counts, 300.0)
        on_ready(server)
        await stop.wait()
    finally:
        await launcher.remove_all()
        await server.stop()
