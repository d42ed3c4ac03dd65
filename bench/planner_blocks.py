"""Where the planner wins or loses against a static split: the trace cut into blocks, each with
both runs' SLO attainment and workers.

`pdserve simulate` reports one number per run (worker-hours, attainment over the trace). This
replays the trace (scaled as `pdserve simulate --workers N` scales it) once with the SLA planner
in the loop and once with a fixed split, and for each block of `--block-s` seconds gives the
requests that arrived in it, the share of them that met both SLOs, and the mean number of
workers (starting and draining included) over the block, per pool. The blocks after the last
arrival (long decodes draining) are reported as the tail. Worker-hours then show where they were
spent, and the attainment what they bought: the same workers meeting fewer requests is a split
the planner got wrong, more workers meeting no more is a pool grown after the load had gone.

The static split is `--static P:D`, or by default the best static split at the planner's own
attainment, as `pdserve simulate` finds it (a search: about a minute at 64 workers).

Run: .venv/bin/python bench/planner_blocks.py --trace ../shared/traces/AzureLLMInferenceTrace_code.csv
     --workers 64 [--static 52:16] [--block-s 300] [--out bench/out/planner_blocks.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcommon.config import PlannerSection, PoolLimits  # noqa: E402
from pdcommon.step_cost import StepCostModel  # noqa: E402
from pdserve.sim.cluster import SimResult, SimSettings  # noqa: E402
from pdserve.sim.command import default_profile, parse_split, parse_trace  # noqa: E402
from pdserve.sim.report import met  # noqa: E402
from pdserve.sim.search import best_static, run_planner, scale_to_workers, settings_from, simulate, sized_split  # noqa: E402
from router.planner import StaticPlanner  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
POOLS = ("prefill", "decode")


def block_rows(result: SimResult, block_s: float, n_blocks: int) -> list[dict]:
    """Per block: requests that arrived in it, the share that met both SLOs, and the mean
    workers per pool over it; then the tail's blocks (workers only) until the last worker ends."""
    counts = [[0, 0] for _ in range(n_blocks)]
    for r in result.requests:
        c = counts[min(int(r.arrival // block_s), n_blocks - 1)]
        c[0] += met(r)
        c[1] += 1
    last = max((w.ended if w.ended is not None else result.end_s) for w in result.workers)
    rows = []
    for k in range(max(n_blocks, int(last // block_s) + 1)):
        lo, hi = k * block_s, (k + 1) * block_s
        mean = {p: 0.0 for p in POOLS}
        for w in result.workers:
            end = w.ended if w.ended is not None else result.end_s
            mean[w.role] = mean.get(w.role, 0.0) + max(0.0, min(end, hi) - max(w.started, lo)) / block_s
        row = {"start_s": lo, "workers": {p: round(v, 2) for p, v in mean.items()}}
        if k < n_blocks:
            row.update(requests=counts[k][1], attainment=counts[k][0] / counts[k][1] if counts[k][1] else None)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="a trace file or synthetic load, as for pdserve simulate")
    ap.add_argument("--workers", type=int, default=64, help="scale the trace to load about this many workers")
    ap.add_argument("--static", help="the fixed split to compare with, P:D (default: the best at the planner's "
                                     "attainment)")
    ap.add_argument("--block-s", type=float, default=300.0)
    ap.add_argument("--out", default=str(OUT / "planner_blocks.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    unbounded = PoolLimits(max_replicas=1 << 20)
    cfg = PlannerSection(mode="sla", profile=str(default_profile()), prefill=unbounded, decode=unbounded)
    settings = settings_from(cfg, SimSettings(profile=StepCostModel.load(default_profile())))
    reqs = parse_trace(args.trace)
    reqs, _ = scale_to_workers(reqs, settings, cfg.target_attainment, args.workers)
    start = sized_split(reqs, settings, cfg.target_attainment, cheapest=True)  # as pdserve simulate starts
    planned, planner = run_planner(reqs, settings, cfg, start)
    if args.static:
        split = parse_split(args.static)
    else:
        split = best_static(reqs, settings, planner["attainment"], start, cache={})["split"]
    fixed, static = simulate(reqs, settings, StaticPlanner(split), split)
    t_first = reqs[0].arrival_s
    n_blocks = int((reqs[-1].arrival_s - t_first) // args.block_s) + 1
    rows_p, rows_s = block_rows(planned, args.block_s, n_blocks), block_rows(fixed, args.block_s, n_blocks)
    out = {"trace": args.trace, "workers": args.workers, "block_s": args.block_s, "requests": len(reqs),
           "planner": {k: planner[k] for k in ("attainment", "worker_hours", "peak_replicas")},
           "static": {"split": split, **{k: static[k] for k in ("attainment", "worker_hours")}},
           "blocks": [{"start_s": p["start_s"], "requests": p.get("requests"),
                       "planner": {"attainment": p.get("attainment"), "workers": p["workers"]},
                       "static": {"attainment": s.get("attainment"), "workers": s["workers"]}}
                      for p, s in zip(rows_p, rows_s, strict=False)],
           "wall_s": time.perf_counter() - t0}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"planner {planner['attainment']:.1%} in {planner['worker_hours']:.1f} worker-h; static {split} "
          f"{static['attainment']:.1%} in {static['worker_hours']:.1f} worker-h")
    for b in out["blocks"]:
        cells = []
        for name in ("planner", "static"):
            side = b[name]
            got = "   -  " if side["attainment"] is None else f"{side['attainment']:6.1%}"
            workers = "+".join(f"{side['workers'].get(p, 0):.1f}" for p in POOLS)
            cells.append(f"{name} {got} {workers:>11}")
        print(f"{b['start_s'] / 60:5.0f} min  {b['requests'] if b['requests'] is not None else 'tail':>5}  "
              + "  |  ".join(cells))
    print(f"wrote {path} ({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
