"""What an idle cluster costs: CPU of pdserve's own processes (router and workers) and, reported
apart, of Ray's daemons, while a 1 prefill + 1 decode cluster on stories260K serves nothing.
Twice: as Ray actors (`pdserve up`; each actor process also runs Ray's core-worker threads) and
as standalone processes (`pdserve router|prefill|decode`, as under Kubernetes).

Writes bench/out/idle.json. Run: .venv/bin/python bench/idle.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent / "out"


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return out


def ray_daemons() -> dict[str, int]:
    import psutil

    names = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env_agent")
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        for n in names:
            if n in cmd and "ray" in cmd:
                out[f"{n}:{p.info['pid']}"] = p.info["pid"]
    return out


def _empty_actor_pid() -> int:
    import os

    import ray

    @ray.remote(num_cpus=0)
    class Empty:
        def pid(self) -> int:
            return os.getpid()

    _empty_actor_pid.actor = Empty.remote()  # kept alive until the cluster stops
    return ray.get(_empty_actor_pid.actor.pid.remote(), timeout=60)


def standalone(seconds: float, settle: float) -> dict[str, float]:
    """The same cluster as three `pdserve` processes (no Ray): percent of a core each."""
    import os
    import subprocess
    import tempfile

    import yaml

    from pdcommon.security import new_token, write_secret
    from pdserve.launch.ports import free_ports

    tmp = Path(tempfile.mkdtemp(prefix="pdidle-"))
    ports = free_ports("127.0.0.1", 3)
    cfg = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    cfg["router"].update(port=ports[0], http_port=ports[1], control_port=ports[2])
    cfg["security"] = {"token_file": str(write_secret(tmp / "token", new_token()))}
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {n: subprocess.Popen([sys.executable, "-m", "pdserve.cli", n, "--config", str(tmp / "cluster.yaml")],
                                 cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n in ("router", "prefill", "decode")}
    try:
        time.sleep(settle + 10)  # loading the model, registering
        pids = {n: p.pid for n, p in procs.items()}
        a = cpu_seconds(pids)
        time.sleep(seconds)
        b = cpu_seconds(pids)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)
    return {k: 100 * (b[k] - a[k]) / seconds for k in a if k in b}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after start before measuring")
    ap.add_argument("--out", default=str(OUT / "idle.json"))
    args = ap.parse_args()

    from pdcommon.config import load_config
    from pdserve.launch.cluster import RayCluster

    cfg = load_config(ROOT / "configs" / "local.yaml", **{"router.port": 0, "router.http_port": 0})
    with RayCluster(cfg) as cluster:
        ours = {"router": cluster.router_pid(), **cluster.worker_pids()}
        ray = ray_daemons()
        # Every actor process also runs Ray's core worker (its own threads and timers): an actor
        # that does nothing, measured beside ours, is that per-process floor.
        ours["empty_ray_actor"] = _empty_actor_pid()
        time.sleep(args.settle)
        a, ra = cpu_seconds(ours), cpu_seconds(ray)
        time.sleep(args.seconds)
        b, rb = cpu_seconds(ours), cpu_seconds(ray)
    per = {k: 100 * (b[k] - a[k]) / args.seconds for k in a if k in b}
    floor = per.pop("empty_ray_actor")
    ray_per = {k: 100 * (rb[k] - ra[k]) / args.seconds for k in ra if k in rb}
    alone = standalone(args.seconds, args.settle)
    result = {"seconds": args.seconds, "pdserve_percent_of_a_core": per, "pdserve_total": sum(per.values()),
              "ray_percent_of_a_core": ray_per, "ray_total": sum(ray_per.values()),
              "empty_ray_actor_percent": floor,
              "pdserve_total_less_ray_actor_floor": sum(per.values()) - floor * len(per),
              "standalone_percent_of_a_core": alone, "standalone_total": sum(alone.values())}
    for k, v in per.items():
        print(f"{k:12s} {v:5.2f}% of a core")
    print(f"an empty Ray actor: {floor:.2f}% (Ray's core worker in every actor process); pdserve less that floor "
          f"per process: {result['pdserve_total_less_ray_actor_floor']:.2f}%")
    print(f"pdserve total {result['pdserve_total']:.2f}% as Ray actors (Ray's daemons {result['ray_total']:.2f}%), "
          f"{result['standalone_total']:.2f}% as standalone processes "
          + ", ".join(f"{k} {v:.2f}%" for k, v in alone.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
