"""The command line as a user runs it: real subprocesses, real ports, clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from pdcommon.client import RouterClient
from pdcommon.config import load_config
from pdserve.launch.ports import free_port, free_ports
from tests.conftest import hf_greedy

ROOT = Path(__file__).resolve().parent.parent
PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def wait_line(proc: subprocess.Popen, needle: str, timeout: float = 180) -> str:
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"never printed {needle!r}; output: {''.join(seen)}; rc={proc.poll()}")


def run_cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _assert_secret_kept(up: subprocess.Popen, output: list[str]) -> None:
    """The token `up` generated is in a 0600 file, and in no process's arguments or environment
    (Ray's workers included) and not in what `up` printed."""
    path = Path(output[1].split("cluster token in ")[1].split(")")[0])
    assert path.stat().st_mode & 0o077 == 0
    token = path.read_text().strip()
    assert len(token) >= 32 and not any(token in line for line in output)
    for proc in [psutil.Process(up.pid), *psutil.Process(up.pid).children(recursive=True)]:
        try:
            assert token not in " ".join(proc.cmdline()), proc.cmdline()[:3]
            assert token not in Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace")
        except psutil.NoSuchProcess:
            continue


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 90) -> list[psutil.Process]:
    """Signal the process, wait for it, return any of its descendants still alive."""
    if proc.poll() is not None:
        return []
    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(sig)
    proc.wait(timeout)
    gone, alive = psutil.wait_procs(kids, timeout=20)
    return alive


def test_up_generate_status_scale_and_clean_stop(stories_path):
    up = subprocess.Popen([*PDSERVE, "up", "--launcher", "ray", "--config", "configs/local.yaml", "--port", "0",
                           "--http-port", "0"],
                          cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = wait_line(up, "router ready at grpc://")
        addr = line.split("grpc://")[1].split()[0]
        output = [line, wait_line(up, "cluster token in ")]
        http = wait_line(up, "OpenAI-compatible HTTP at http://").split("HTTP at ")[1].split("/v1")[0]
        import urllib.request

        with urllib.request.urlopen(f"{http}/v1/models", timeout=30) as resp:
            assert json.load(resp)["data"][0]["id"] == "stories260K"
        r = run_cli("generate", "--router", addr, "--max-tokens", "20", "--json", "Once upon a time")
        assert r.returncode == 0, r.stderr
        msgs = [json.loads(x) for x in r.stdout.splitlines()]
        final = msgs[-1]
        for key in ("text", "token_ids", "finish_reason", "usage", "timings"):
            assert key in final
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 20
        ids = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS
        assert final["token_ids"] == hf_greedy(stories_path, ids, 20)["token_ids"]
        assert "".join(m["text"] for m in msgs).startswith(", there was a little girl named Lily")
        r = run_cli("generate", "--router", addr, "Once upon a time")
        assert r.returncode == 0 and "TTFT" in r.stderr
        r = run_cli("status", "--router", addr)
        assert r.returncode == 0 and "prefill-0" in r.stdout and "decode-0" in r.stdout
        assert " busy " in r.stdout.splitlines()[3]  # the header: each engine's busy share
        # Ray actors freeze their start-up heap too (after they report ready), and /metrics
        # shows it per worker once a heartbeat has carried it.
        assert min(_frozen_counts(addr, 15.0).values()) > 0
        with urllib.request.urlopen(f"{http}/metrics", timeout=30) as resp:
            lines = resp.read().decode().splitlines()
        gauges = [ln for ln in lines if ln.startswith("pdserve:worker_gc_frozen_objects{")]
        assert len(gauges) == 2 and all(float(ln.split()[-1]) > 50_000 for ln in gauges), gauges
        # Scale is on the control plane: `up` keeps the cluster token where this machine's operator
        # commands find it; with another token it is refused.
        r = run_cli("scale", "--router", addr, "--pool", "prefill", "--replicas", "2",
                    env={"PDSERVE_CLUSTER_TOKEN": "not-the-cluster-token"})
        assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
        r = run_cli("scale", "--router", addr, "--pool", "prefill", "--replicas", "2")
        assert r.returncode == 0 and "prefill-1" in r.stdout
        _assert_secret_kept(up, output)
        r = run_cli("generate", "--router", addr, "--temperature", "-1", "hi")
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr
    finally:
        alive = stop(up)
    assert up.returncode == 0
    assert not alive, f"processes left behind: {[p.cmdline()[:3] for p in alive]}"


def _up_processes(tmp_path: Path, env: dict | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    cfg = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    cfg["heartbeat"] = {"interval_s": 0.5, "timeout_s": 2.0}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # No --launcher: on one host, not joining a Ray cluster, `auto` starts worker processes.
    up = subprocess.Popen([*PDSERVE, "up", "--config", str(path), "--port", "0",
                           "--http-port", "0", "--control-port", str(free_port("127.0.0.1"))],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})})
    try:
        line = wait_line(up, "router ready at grpc://", timeout=60)
        return up, line.split("grpc://")[1].split()[0], [line, wait_line(up, "cluster token in ")]
    except BaseException:
        up.kill()  # its workers follow it (PR_SET_PDEATHSIG)
        up.wait(10)
        raise


def _frozen_counts(addr: str, timeout_s: float) -> dict[str, int]:
    """Each worker's heartbeat count of frozen objects by role, once every one is above 0 (or
    what the router has at the deadline)."""
    end = time.monotonic() + timeout_s
    with RouterClient(addr) as client:
        while True:
            frozen = {w.role: w.gc_frozen_objects for w in client.status().workers}
            if (frozen and min(frozen.values()) > 0) or time.monotonic() > end:
                return frozen
            time.sleep(0.2)


def _children(up: subprocess.Popen) -> dict[str, psutil.Process]:
    """`pdserve up`'s live worker processes by role (a killed one is a zombie until `up` reaps it)."""
    out = {}
    for p in psutil.Process(up.pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.cmdline()[2:3] == ["pdserve.cli"]:
                out[p.cmdline()[3]] = p
        except psutil.Error:  # gone meanwhile
            continue
    return out


def test_up_with_worker_processes(stories_path, tmp_path):
    """`pdserve up` on one host (the `auto` launcher: no Ray); the router in `up`, each worker a
    child process.
    It serves greedy tokens equal to transformers', replaces a worker that dies, stops cleanly,
    and its workers do not outlive an `up` that is killed."""
    up, addr, output = _up_processes(tmp_path)
    try:
        assert "worker processes" in output[0]
        kids = _children(up)
        assert sorted(kids) == ["decode", "prefill"]
        ids = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS
        want = hf_greedy(stories_path, ids, 20)["token_ids"]
        r = run_cli("generate", "--router", addr, "--max-tokens", "20", "--json", "Once upon a time")
        assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["token_ids"] == want, r.stderr
        _assert_secret_kept(up, output)
        # Each worker process froze its start-up heap once serving (pdcommon/gc_heap.py); the
        # heartbeat says how much of it the collector no longer walks (torch alone is ~10^5 objects).
        # A worker registers before it freezes, so the router may not have heard the count yet.
        frozen = _frozen_counts(addr, 15.0)
        assert sorted(frozen) == ["decode", "prefill"] and min(frozen.values()) > 50_000, frozen
        kids["decode"].kill()  # the router notices the silence and starts a replacement through the launcher
        end = time.monotonic() + 60
        while time.monotonic() < end and _children(up).get("decode", kids["decode"]).pid == kids["decode"].pid:
            time.sleep(0.5)
        r = run_cli("generate", "--router", addr, "--max-tokens", "20", "--json", "Once upon a time")
        assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["token_ids"] == want, r.stderr
        r = run_cli("status", "--router", addr)
        assert "decode-1" in r.stdout and "decode-0" not in r.stdout
    finally:
        alive = stop(up)
    assert up.returncode == 0
    assert not alive, f"processes left behind: {[p.cmdline()[:4] for p in alive]}"

    # A token given in the environment reaches the workers through the file `up` writes, not theirs.
    secret = "env-token-" + "x" * 40
    up, addr, output = _up_processes(tmp_path, {"PDSERVE_CLUSTER_TOKEN": secret})
    kids = list(_children(up).values())
    try:
        assert len(kids) == 2
        for k in kids:
            assert secret not in Path(f"/proc/{k.pid}/environ").read_bytes().decode(errors="replace")
        assert run_cli("status", "--router", addr).returncode == 0
    finally:
        up.kill()
        up.wait(10)
    gone, alive = psutil.wait_procs(kids, timeout=40)
    assert not alive, f"workers outlived a killed `pdserve up`: {[p.cmdline()[:4] for p in alive]}"


def test_missing_model_names_the_fix():
    r = run_cli("up", "--model", "/nonexistent/model")
    assert r.returncode != 0 and "not found" in r.stderr and "--model" in r.stderr


def _torch_loaded(pid: int) -> bool:
    """From outside the process: is any libtorch library mapped into it?"""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _http(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_standalone_components_and_a_torch_free_router(chat_model, tmp_path):
    """`pdserve router|prefill|decode` as Kubernetes runs them: separate processes on their own
    ports, workers registering and heartbeating to the router. The router serves a completion
    and a chat request without ever loading torch."""
    rport, hport, cport = free_ports("127.0.0.1", 3)
    cfg = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    cfg.update(model=chat_model, heartbeat={"interval_s": 0.5})
    cfg["router"].update(host="127.0.0.1", port=rport, http_port=hport, control_port=cport)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PDSERVE_CLUSTER_TOKEN", None)
    # No secret configured: a standalone component refuses to start rather than make one up.
    r = subprocess.run([*PDSERVE, "router", "--config", str(path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no cluster secret is configured" in r.stderr, r.stderr
    from pdcommon.security import new_token, write_secret

    cfg["security"] = {"token_file": str(write_secret(tmp_path / "token", new_token()))}
    path.write_text(yaml.safe_dump(cfg))
    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen([*PDSERVE, name, "--config", str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    # The router first: its ports were picked above and freed, and a worker binding port 0 at the
    # same moment could be given one of them.
    procs = {"router": start("router")}
    try:
        assert f"127.0.0.1:{rport}" in wait_line(procs["router"], "router serving on")
        procs.update(prefill=start("prefill"), decode=start("decode"))
        wait_line(procs["prefill"], "serving on")
        wait_line(procs["decode"], "serving on")
        addr = f"127.0.0.1:{rport}"
        end = time.monotonic() + 60
        while "decode-" not in run_cli("status", "--router", addr).stdout or \
                "prefill-" not in run_cli("status", "--router", addr).stdout:
            assert time.monotonic() < end
            time.sleep(0.5)
        r = run_cli("generate", "--router", addr, "--max-tokens", "12", "--json", "Once upon a time")
        final = json.loads(r.stdout.splitlines()[-1])
        assert final["token_ids"] == hf_greedy(chat_model, [1, 403, 407, 261, 378], 12)["token_ids"]
        r = run_cli("scale", "--router", addr, "--pool", "decode", "--replicas", "2", "--config", str(path))
        assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr
        base = f"http://127.0.0.1:{hport}/v1"
        done = _http(base + "/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
        assert done["choices"][0]["text"] and done["usage"]["completion_tokens"] == 12
        chat = _http(base + "/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}],
                                                  "max_tokens": 8, "temperature": 0})
        assert chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"] == 8
        assert not _torch_loaded(procs["router"].pid), "the router process loaded torch"
        assert _torch_loaded(procs["decode"].pid)  # the probe does see torch where it is loaded
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(30)
    assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}


@pytest.mark.parametrize("cmd", [["status", "--router", "127.0.0.1:1"]])
def test_unreachable_router_is_an_error(cmd):
    r = run_cli(*cmd, timeout=60)
    assert r.returncode != 0


def test_up_joins_an_existing_ray_cluster():
    """`ray start --head` first (as on a real cluster), then `pdserve up --ray-address` joins it:
    the router and workers are actors of that cluster, and stopping pdserve leaves it running."""
    import shutil
    import tempfile

    port, client_port = free_ports("127.0.0.1", 2)
    tmp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")  # short: Ray's socket paths must fit AF_UNIX limits
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                             f"--ray-client-server-port={client_port}",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_line(head, "Ray runtime started", timeout=120)
        up = subprocess.Popen([*PDSERVE, "up", "--port", "0", "--http-port", "0", "--ray-address",
                               f"127.0.0.1:{port}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        try:
            addr = wait_line(up, "router ready at grpc://").split("grpc://")[1].split()[0]
            probe = ("import ray, sys; ray.init(address=sys.argv[1], _node_ip_address='127.0.0.1', "
                     "log_to_driver=False); "
                     "print(sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)))")
            r = subprocess.run([sys.executable, "-c", probe, f"127.0.0.1:{port}"], capture_output=True, text=True,
                               timeout=120, env=dict(os.environ, RAY_AUTH_MODE="token"))
            assert "-router'" in r.stdout and "-decode-0'" in r.stdout, r.stdout + r.stderr
            r = run_cli("generate", "--router", addr, "--max-tokens", "5", "Once upon a time")
            assert r.returncode == 0, r.stderr
        finally:
            alive = stop(up)
        assert up.returncode == 0 and not alive
        assert head.poll() is None, "stopping pdserve must not stop the cluster it joined"
    finally:
        if head.poll() is None:
            kids = psutil.Process(head.pid).children(recursive=True)
            head.send_signal(signal.SIGTERM)
            head.wait(60)
            psutil.wait_procs(kids, timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_the_shipped_cluster_configs_load(name):
    """Every cluster YAML in configs/ passes the schema as shipped (configs/ray/ holds Ray's own)."""
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.roles and all(cfg.pool(role).replicas >= 1 for role in cfg.roles)
