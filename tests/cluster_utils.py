"""Test helpers: cluster configs on several loopback addresses, and pool checks."""

from __future__ import annotations

import time
from pathlib import Path

from pdcommon.client import RouterClient
from pdcommon.config import ClusterConfig, load_config, set_dotted
from pdcommon.security import new_token, write_secret
from pdserve.launch.inprocess import InProcessCluster

__all__ = ["InProcessCluster", "cluster_config", "make_config", "send_once", "wait_pools_empty"]


def make_config(model: str, **overrides) -> ClusterConfig:
    base = {"model": model, "router.port": 0, "router.http_port": 0, "router.host": "127.0.0.1",
            "prefill.host": "127.0.0.1", "decode.host": "127.0.0.1", "colocated.host": "127.0.0.1",
            "heartbeat.interval_s": 0.3, "engine.num_threads": 1,
            # stories260K's prompts are all short: every one goes through the prefill pool and its
            # KV ships, the path these tests are about (local prefill has its own test).
            "router.local_prefill_max_tokens": 0}
    base.update(overrides)
    return load_config(None, **base)


HEARTBEAT = 0.5


def send_once(transport: str, dest: str, header, frames, timeout_s: float = 10, key: bytes | None = None):
    """Send one transfer from a fresh sender and wait for its outcome (its own timeout ends it)."""
    from transfer import make_sender

    sender = make_sender(transport)
    try:
        h = sender.send(dest, header, frames, timeout_s=timeout_s, key=key)
        while not h.done:
            sender.poll()
            time.sleep(0.002)
        return h
    finally:
        sender.close()


def cluster_config(model: str, transport: str, prefill: int, decode: int, **extra):
    return load_config(Path(__file__).resolve().parent.parent / "configs" / "local.yaml", **{
        "model": model, "router.port": 0, "router.http_port": 0, "transfer.transport": transport,
        "heartbeat.interval_s": HEARTBEAT,
        "prefill.replicas": prefill, "decode.replicas": decode, "engine.kv_cache_memory_bytes": 32 << 20, **extra})


def wait_pools_empty(client: RouterClient, timeout: float = 20.0) -> None:
    """Every worker's pool back to zero referenced blocks (as its heartbeats report)."""
    time.sleep(2.5 * HEARTBEAT)
    end = time.monotonic() + timeout
    while True:
        st = client.status()
        used = {w.worker_id: w.used_blocks for w in st.workers if w.used_blocks or w.num_running}
        if not used:
            return
        assert time.monotonic() < end, f"blocks still referenced: {used}"
        time.sleep(HEARTBEAT)


class ProcessCluster:
    """Router and workers as separate `pdserve router|prefill|decode` processes on 127.0.0.1, so a
    test can SIGKILL or SIGSTOP one worker. Stops (and reaps) everything it started."""

    def __init__(self, model: str, tmp_path: Path, prefill: int = 2, decode: int = 2, security: str = "token",
                 **overrides) -> None:
        import os
        import subprocess
        import sys

        import yaml

        # Standalone components never make up a secret: like an operator, the test provides one.
        if security == "mtls":
            from pdserve.certs import make_certs

            sec = {"mode": "mtls", "certs_dir": str(make_certs(tmp_path / "certs"))}
        else:
            sec = {"mode": security, "token_file": str(write_secret(tmp_path / "cluster.token", new_token()))}
        # Every port is picked by the process that binds it (a port chosen here and bound later can be
        # taken meanwhile, e.g. by a worker binding port 0); workers learn the router's from it.
        cfg = {"model": model, "router": {"port": 0, "http_port": 0}, "security": sec,
               "heartbeat": {"interval_s": 0.3, "timeout_s": 2.0}, "engine": {"num_threads": 1}}
        for key, value in overrides.items():
            set_dotted(cfg, key, value)
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg))
        cmd = [sys.executable, "-m", "pdserve.cli"]
        env = {"PDSERVE_LOG_FORMAT": "text", **os.environ, "OMP_NUM_THREADS": "1"}
        root = Path(__file__).resolve().parent.parent
        self.logs = tmp_path  # each process's output: <name>.log, for a failing test to show

        def start(name: str, *args: str) -> subprocess.Popen:
            with open(tmp_path / f"{name}.log", "wb") as out:
                return subprocess.Popen([*cmd, *args, "--config", str(path)], cwd=root, env=env, stdout=out,
                                        stderr=subprocess.STDOUT)

        self.procs: dict[str, subprocess.Popen] = {"router": start("router", "router")}
        try:
            self.address = self._router_address(tmp_path / "router.log")
            with RouterClient(self.address) as c:
                control = c.status().control_address
            for role, n in (("prefill", prefill), ("decode", decode)):
                for i in range(n):
                    self.procs[f"{role}-{i}"] = start(f"{role}-{i}", role, "--worker-id", f"{role}-{i}", "--router",
                                                      control)
            self.wait_workers(prefill + decode)
        except BaseException:  # the fixture never gets this object to stop: stop what was started here
            self.stop()
            raise

    def _router_address(self, log: Path, timeout: float = 60) -> str:
        """The public address the router process printed once serving."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("router serving on "):
                    return line.removeprefix("router serving on ").strip()
            assert self.procs["router"].poll() is None, f"the router exited: {log.read_text()[-2000:]}"
            time.sleep(0.1)
        raise AssertionError(f"the router never served: {log.read_text()[-2000:]}")

    def wait_workers(self, n: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                with RouterClient(self.address) as c:
                    if len([w for w in c.status().workers if w.state == "active"]) >= n:
                        return
            except Exception:  # router not up yet
                pass
            assert time.monotonic() < end, f"{n} workers never registered"
            time.sleep(0.2)

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def client(self) -> RouterClient:
        return RouterClient(self.address)

    def stop(self) -> None:
        import signal

        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except Exception:
                p.kill()
                p.wait(10)
