"""Simulator fidelity (issue 11): does `pdserve simulate` predict what `pdserve bench` measures?

For each shape (1 prefill + 1 decode worker at 1 thread each; 1 colocated worker at 2 threads),
on the 50M benchmark model:
1. `pdserve profile` of the pool's engine (the disaggregated one with its KV transfer);
2. `pdserve up`, then the saturation rate: 32 requests of 512 in / 64 out sent at once,
   completed requests per second;
3. `pdserve bench` at 30%, 60% and 80% of that rate (Poisson, 512 / 64, about a minute each),
   with SLOs from the profile: TTFT 3x its unloaded 512-token prefill, TPOT 2x its batch-1 ITL;
4. the simulator on the same workload (rate, count, lengths, SLOs) with the fresh profile, the
   median of five Poisson schedules: as profiled, and calibrated by how much slower a served step
   is than the profile's, measured with five requests sent one at a time (served TTFT over the
   profile's prefill, served TPOT over its ITL: `--step-scale` of `pdserve simulate`), and what
   eight streams at once add per sequence beyond that (`--seq-overhead-ms`).

Writes bench/out/sim_fidelity.json: per shape and load, measured and predicted TTFT p50/p90,
TPOT p50/p90 and goodput, and predicted / measured. Target: every ratio within 0.8-1.2.
Run: .venv/bin/python bench/sim_fidelity.py [--shapes disagg,colocated] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
OUT = ROOT / "bench" / "out"
MODEL = OUT / "llama-50m"
PROMPT, OUTPUT = 512, 64
BATCH = 8
SHAPES = {
    "disagg": {"mode": "disaggregated", "engine": {"num_threads": 1}, "prefill": {"replicas": 1},
               "decode": {"replicas": 1}, "ports": (50081, 8003, 50082)},
    "colocated": {"mode": "colocated", "engine": {"num_threads": 2}, "colocated": {"replicas": 1},
                  "ports": (50091, 8004, 50092)},
}


def write_config(name: str, tmp: Path) -> Path:
    import yaml

    spec = dict(SHAPES[name])
    port, http, control = spec.pop("ports")
    # Every prompt through the prefill pool: the simulator does not model local prefill.
    cfg = {"model": str(MODEL), **spec, "router": {"port": port, "http_port": http, "control_port": control,
                                                   "local_prefill_max_tokens": 0}}
    cfg["engine"] = {**cfg["engine"], "kv_cache_memory_bytes": 1 << 30}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def profile(cfg: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--config", str(cfg), "--out", str(out)],
                   check=True, cwd=ROOT)


def bench(router: str, rate: float, n: int, slo_ms: tuple[float, float], seed: int,
          concurrency: int | None = None) -> dict:
    from pdserve.loadgen import Load, Workload, run_benchmark

    load = Load(rate if rate > 0 else math.inf, "poisson", concurrency, 0)
    report = asyncio.run(run_benchmark(router, Workload(n, PROMPT, OUTPUT, 0.0, 0, seed), load, "grpc", *slo_ms,
                                       progress=False))
    return report["summary"]


def simulate(prof_path: Path, mode: str, rate: float, n: int, slo_ms: tuple[float, float], seed: int,
             scale: tuple[float, float, float] = (1.0, 1.0, 0.0)) -> dict:
    from pdcommon.step_cost import StepCostModel
    from pdserve.sim.cluster import SimSettings
    from pdserve.sim.search import simulate as run
    from pdserve.sim.traces import poisson
    from router.planner import Slos, StaticPlanner

    prof = StepCostModel.load(prof_path)
    split = {"prefill": 1, "decode": 1} if mode == "disaggregated" else {"colocated": 1}
    settings = SimSettings(profile=prof, mode=mode, slos=Slos(slo_ms[0] / 1e3, slo_ms[1] / 1e3, 3.0, 2.0),
                           routing="least_loaded", seed=seed, prefill_scale=scale[0], decode_scale=scale[1],
                           seq_overhead_s=scale[2])
    runs = [run(poisson(rate, n, PROMPT, OUTPUT, seed=s), settings, StaticPlanner(split), split)[1]
            for s in range(seed, seed + 5)]  # five schedules: the measured run is one draw of many
    return {k: sorted(r[k] for r in runs)[2] for k in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s",
                                                        "goodput", "attainment")}


def run_shape(name: str, seconds: float, tmp: Path) -> dict:
    from serve import Server

    from pdcommon.step_cost import StepCostModel

    cfg = write_config(name, tmp)
    prof_path = OUT / f"profile_{name}.json"
    profile(cfg, prof_path)
    prof = StepCostModel.load(prof_path)
    slo_ms = (3e3 * prof.prefill_seconds(PROMPT), 2e3 * prof.itl_seconds(1, PROMPT + OUTPUT // 2))
    port, http, _ = SHAPES[name]["ports"]
    router = f"127.0.0.1:{port}"
    rows = []
    with Server(f"{sys.executable} -m pdserve.cli up --config {cfg}", f"http://127.0.0.1:{http}"):
        bench(router, 0.0, 8, slo_ms, 99)  # warm-up
        alone = bench(router, 0.0, 5, slo_ms, 97, concurrency=1)  # one at a time: the calibration
        eight = bench(router, 0.0, 16, slo_ms, 96, concurrency=BATCH)  # and eight streams at once
        sat = bench(router, 0.0, 32, slo_ms, 98)["request_throughput"]
        for frac in (0.3, 0.6, 0.8):
            rate = frac * sat
            n = max(30, round(rate * seconds))
            # A fresh seed per load: the same prompts again would hit the prefix cache.
            measured = bench(router, rate, n, slo_ms, 10 + round(frac * 10))
            rows.append({"load": frac, "rate": rate, "requests": n, "measured": {
                "ttft_p50_s": measured["ttft_ms"]["p50"] / 1e3, "ttft_p90_s": measured["ttft_ms"]["p90"] / 1e3,
                "tpot_p50_s": measured["tpot_ms"]["p50"] / 1e3, "tpot_p90_s": measured["tpot_ms"]["p90"] / 1e3,
                "goodput": measured["goodput_requests"] / n * rate,
                "attainment": measured["goodput_requests"] / n}})
            print(name, frac, rows[-1]["measured"], flush=True)
    # Calibration from the one-at-a-time requests: how much slower a served step is than the
    # profile's (the engine alone); the simulator is run with and without it.
    xfer = prof.transfer_seconds(PROMPT) / (OUTPUT - 1) if SHAPES[name]["mode"] == "disaggregated" else 0.0
    itl = sum(prof.itl_seconds(1, PROMPT + 1 + k) for k in range(OUTPUT - 1)) / (OUTPUT - 1)
    prefill_scale = alone["ttft_ms"]["p50"] / 1e3 / prof.prefill_seconds(PROMPT)
    decode_scale = max(alone["tpot_ms"]["p50"] / 1e3 - xfer, 1e-6) / itl
    # Eight streams: what their TPOT has beyond eight sequences' scaled step is the stack's
    # per-sequence cost (each streamed token takes CPU from the engine on these cores).
    itl8 = sum(prof.itl_seconds(BATCH, PROMPT + 1 + k) for k in range(OUTPUT - 1)) / (OUTPUT - 1)
    per_seq = max(0.0, (eight["tpot_ms"]["p50"] / 1e3 - xfer - decode_scale * itl8) / BATCH)
    scale = (prefill_scale, decode_scale, per_seq)
    for row in rows:
        for tag, sc in (("predicted", scale), ("predicted_uncalibrated", (1.0, 1.0, 0.0))):
            row[tag] = simulate(prof_path, SHAPES[name]["mode"], row["rate"], row["requests"], slo_ms, 1, sc)
        row["ratio"] = {k: (row["predicted"][k] / v if v else None) for k, v in row["measured"].items()}
        row["ratio_uncalibrated"] = {k: (row["predicted_uncalibrated"][k] / v if v else None)
                                     for k, v in row["measured"].items()}
        row["within_20pct"] = all(r is not None and 0.8 <= r <= 1.2 for k, r in row["ratio"].items()
                                  if k != "attainment")
    return {"saturation_rate": sat, "slo_ms": slo_ms, "profile": str(prof_path), "step_scale": scale,
            "alone": {"ttft_ms_p50": alone["ttft_ms"]["p50"], "tpot_ms_p50": alone["tpot_ms"]["p50"]},
            "eight_streams_tpot_ms_p50": eight["tpot_ms"]["p50"], "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="disagg,colocated")
    ap.add_argument("--seconds", type=float, default=60.0, help="about how long each load runs")
    args = ap.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            result[name] = run_shape(name, args.seconds, Path(tmp))
    OUT.mkdir(exist_ok=True)
    (OUT / "sim_fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    for name, res in result.items():
        print(f"{name}: saturation {res['saturation_rate']:.2f} req/s, SLOs TTFT {res['slo_ms'][0]:.0f} ms, "
              f"TPOT {res['slo_ms'][1]:.1f} ms; served steps / profile: prefill {res['step_scale'][0]:.2f}, "
              f"decode {res['step_scale'][1]:.2f}, + {res['step_scale'][2] * 1e3:.2f} ms per sequence")
        for row in res["rows"]:
            r = {k: "n/a" if v is None else f"{v:.2f}" for k, v in row["ratio"].items()}
            print(f"  {row['load']:.0%} ({row['rate']:.2f} req/s): predicted/measured TTFT p50 {r['ttft_p50_s']} "
                  f"p90 {r['ttft_p90_s']}, TPOT p50 {r['tpot_p50_s']} p90 {r['tpot_p90_s']}, goodput "
                  f"{r['goodput']} -> {'ok' if row['within_20pct'] else 'OFF'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
