"""How much any planner could save on a trace: a hindsight bound against the best static split.

The trace (scaled as `pdserve simulate --workers N` scales it) is cut into blocks of `--block-s`
seconds. For each block and each size of one pool (the other held at the best static split's),
the simulator serves that block's requests alone. Then the schedule of sizes with the fewest
worker-hours that meets the best static split's attainment over the whole trace is found
exactly (`optimum`: a dynamic program over the blocks, by requests met so far), with no other
rule ("exact") and with the issue's oscillation rule, no pool growing within `--hold-s` of the
start of a block where it shrank ("steady"). The Lagrange sweep it began with (`cheapest`: each
block takes the size that minimizes workers x hours - multiplier x requests met) is kept for
comparison; it finds a schedule, not the best one, and with few blocks it overshoots the target.

It is optimistic for the planner: it knows every block's arrivals in advance, its workers start
at once, and each block starts with empty queues (no backlog carried over). A planner that
reacts to what it observes cannot do better, so a small bound says the trace leaves a planner
little to win against a static split chosen in hindsight.

A large bound says only that the blocks differ, not that a planner can tell in advance how.
The causal schedules (`lagged`) ask that: each block is sized from the exact curves of the blocks
before it (the last 1, 2 or 4, or all of them), as no planner's model knows them, with the
multiplier that trades workers for requests met chosen in hindsight, workers that start at once
and no rule against growing back. Where even they spend more than the static split, what the
trace's past says about its next minutes is worth less than a split fitted to its whole hour.

Run: .venv/bin/python bench/planner_bound.py --trace ../shared/traces/AzureLLMInferenceTrace_code.csv
     --workers 64 [--block-s 300] [--vary prefill] [--split P:D] [--out bench/out/planner_bound.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcommon.config import PlannerSection, PoolLimits  # noqa: E402
from pdcommon.step_cost import StepCostModel  # noqa: E402
from pdserve.sim.cluster import SimSettings  # noqa: E402
from pdserve.sim.command import default_profile, parse_split, parse_trace  # noqa: E402
from pdserve.sim.search import best_static, scale_to_workers, settings_from, simulate, sized_split  # noqa: E402
from router.planner import StaticPlanner  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
PLATEAU = 0.999  # a block met this well needs no bigger pool
LAGS = (1, 2, 4, 0)  # the causal schedules: sized from the last 1, 2, 4 blocks' curves, and from all before


def block_curves(blocks: list[list], settings: SimSettings, vary: str, fixed: dict[str, int], top: int,
                 grid: int = 40) -> list[dict[int, int]]:
    """Per block: requests met at each of about `grid` sizes of the varied pool up to `top`,
    served alone by a static split."""
    step = max(1, top // grid)
    curves = []
    for reqs in blocks:
        met: dict[int, int] = {}
        for size in range(1, top + 1, step):
            split = {**fixed, vary: size}
            _, s = simulate(reqs, settings, StaticPlanner(split), split)
            met[size] = round(s["attainment"] * len(reqs))
            if s["attainment"] >= PLATEAU:
                break
        curves.append(met)
    return curves


def cheapest(curves: list[dict[int, int]], spans_h: list[float], fixed_size: int, total: int, target: float,
             ) -> dict | None:
    """The schedule of fewest worker-hours meeting `target` of `total` requests, over the
    Lagrange multipliers' range (sizes per block minimizing size x hours - multiplier x met)."""
    best = None
    for i in range(1, 4001):
        lam = i * 1e-4
        sizes = [min(c, key=lambda n, c=c, h=h: n * h - lam * c[n]) for c, h in zip(curves, spans_h, strict=True)]
        met = sum(c[n] for c, n in zip(curves, sizes, strict=True))
        hours = sum((n + fixed_size) * h for n, h in zip(sizes, spans_h, strict=True))
        if met >= target * total and (best is None or hours < best["worker_hours"]):
            best = {"attainment": met / total, "worker_hours": hours, "sizes": sizes}
    return best


def lagged(curves: list[dict[int, int]], counts: list[int], spans_h: list[float], fixed_size: int, total: int,
           target: float, start: int, lag: int = 0) -> dict | None:
    """The causal counterpart of `optimum`: each block's size chosen from the blocks before it
    only, as well as a planner could that knew their curves exactly. Block 0 runs `start`; each
    later one the size minimizing size x hours - multiplier x its predicted requests met, where
    the prediction is the mean share met at that size over the last `lag` blocks (0: all before),
    times their mean requests. The multiplier is the cheapest that meets `target` over the whole
    trace, chosen in hindsight, and workers start at once with no rule against growing back: it
    is optimistic for a planner, so where it spends more than the static split, a planner that
    learns the load from what it has seen does too."""
    sizes = sorted({k for c in curves for k in c})
    shares = [{n: met_at(c, n) / max(k, 1) for n in sizes} for c, k in zip(curves, counts, strict=True)]
    predicted: list[dict[int, float]] = [{}]
    for b in range(1, len(curves)):
        past = range(max(0, b - lag) if lag else 0, b)
        seen = sum(counts[j] for j in past) / len(past)
        predicted.append({n: seen * sum(shares[j][n] for j in past) / len(past) for n in sizes})
    best = None
    for i in range(2001):
        lam = 10 ** (-6 + 7 * i / 2000)  # requests met are worth 1e-6 to 10 worker-hours each
        plan = [start] + [min(sizes, key=lambda n, p=p, h=h: n * h - lam * p[n])
                          for p, h in zip(predicted[1:], spans_h[1:], strict=True)]
        met = sum(met_at(c, n) for c, n in zip(curves, plan, strict=True))
        hours = sum((n + fixed_size) * h for n, h in zip(plan, spans_h, strict=True))
        if met >= target * total and (best is None or hours < best["worker_hours"]):
            best = {"attainment": met / total, "worker_hours": hours, "sizes": plan}
    return best


def met_at(curve: dict[int, int], size: int) -> int:
    """Requests a block meets at `size`: its curve's value at the largest size tried up to it (a
    curve stops at its plateau, so larger sizes meet as many)."""
    return curve[max(k for k in curve if k <= size)]


def _dp_blocks(curves: list[dict[int, int]], starts_s: list[float], spans_h: list[float], fixed_size: int,
               total: int, hold_s: float | None):
    """optimum's forward pass. Returns the last block's states, (size, start of the binding shrink
    or None) -> hours by requests met, and per block the states before it and how each entry after
    it was reached: per state and requests met, (index of the state before, size)."""
    import numpy as np

    sizes = sorted({k for c in curves for k in c})
    inf = float("inf")
    states: dict[tuple[int | None, float | None], np.ndarray] = {(None, None): np.full(total + 1, inf)}
    states[(None, None)][0] = 0.0
    back: list[tuple[list[tuple], dict[tuple, tuple[np.ndarray, np.ndarray]]]] = []
    for curve, start, h in zip(curves, starts_s, spans_h, strict=True):
        gain = {n: met_at(curve, n) for n in sizes}
        nxt: dict[tuple, np.ndarray] = {}
        how: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        for si, ((m, shrunk), hours) in enumerate(states.items()):
            if shrunk is not None and (hold_s is None or start - shrunk >= hold_s):
                shrunk = None
            for n in sizes:
                if m is not None and n > m and shrunk is not None:
                    continue  # growing back within hold_s of a shrink
                key = (n, start if hold_s is not None and m is not None and n < m else shrunk)
                cand = np.full(total + 1, inf)
                g = gain[n]
                cand[g:] = hours[:total + 1 - g] + (n + fixed_size) * h
                if key not in nxt:
                    nxt[key] = np.full(total + 1, inf)
                    how[key] = (np.zeros(total + 1, np.int32), np.zeros(total + 1, np.int32))
                better = cand < nxt[key]
                nxt[key][better] = cand[better]
                how[key][0][better], how[key][1][better] = si, n
        back.append((list(states), how))
        states = nxt
    return states, back


def optimum(curves: list[dict[int, int]], starts_s: list[float], spans_h: list[float], fixed_size: int,
            total: int, target: float, hold_s: float | None = None) -> dict | None:
    """The schedule of fewest worker-hours whose blocks meet `target` of `total` requests, exactly
    (over the sizes tried): a dynamic program over the blocks whose state is the requests met so
    far, the last size and, with `hold_s`, the start of a shrink while it still binds: no pool
    grows within `hold_s` of the start of a block where it shrank (the issue counts a scale-down
    reversed within 10 minutes as an oscillation). The Lagrange sweep (`cheapest`) finds a
    schedule, not the best one: with few blocks it overshoots the target (10-minute blocks on
    the Azure code trace: 91.5% for 90.2%)."""
    import numpy as np

    states, back = _dp_blocks(curves, starts_s, spans_h, fixed_size, total, hold_s)
    need = math.ceil(target * total)
    best_key, best_met, best_h = None, 0, float("inf")
    for key, hours in states.items():
        met = need + int(np.argmin(hours[need:]))
        if hours[met] < best_h:
            best_key, best_met, best_h = key, met, float(hours[met])
    if best_key is None:
        return None
    path, key, met = [], best_key, best_met
    for curve, (before, how) in zip(reversed(curves), reversed(back), strict=True):  # walk the choices back
        prev, size = how[key]
        path.append(int(size[met]))
        key = before[prev[met]]
        met -= met_at(curve, path[-1])
    path.reverse()
    # The walk back must land where the program said: same requests met, same hours.
    again = sum(met_at(c, n) for c, n in zip(curves, path, strict=True))
    hours_again = sum((n + fixed_size) * h for n, h in zip(path, spans_h, strict=True))
    if again != best_met or abs(hours_again - best_h) > 1e-6 * max(best_h, 1.0):
        raise AssertionError(f"schedule walk-back: {again} met / {hours_again} h, expected {best_met} / {best_h}")
    return {"attainment": best_met / total, "worker_hours": best_h, "sizes": path}


def split_blocks(reqs: list, block_s: float) -> tuple[list[list], list[float], list[float]]:
    """The trace in blocks of block_s seconds from its first arrival, those with arrivals only:
    their requests, start (seconds after the first arrival) and span in hours (the last block
    ends at the last arrival)."""
    t_first, t_last = reqs[0].arrival_s, reqs[-1].arrival_s
    n_blocks = int((t_last - t_first) // block_s) + 1
    blocks: list[list] = [[] for _ in range(n_blocks)]
    for r in reqs:
        blocks[int((r.arrival_s - t_first) // block_s)].append(r)
    kept = [i for i, b in enumerate(blocks) if b]
    return ([blocks[i] for i in kept], [i * block_s for i in kept],
            [min(block_s, t_last - t_first - i * block_s) / 3600 for i in kept])


def report(out: dict, static: dict) -> None:
    split = static["split"]
    print(f"best static {split}: {static['attainment']:.1%}, {out['best_static_block_hours']:.1f} worker-h "
          "over the blocks")
    block_s, vary, hold_s = out["block_s"], out["vary"], out["hold_s"]
    for key, saved, what in (("bound", "most_saved", f"hindsight bound ({block_s:.0f} s blocks, {vary} varied)"),
                             ("exact", "most_saved_exact", "exact optimum"),
                             ("bound_steady", "most_saved_steady",
                              f"exact, without growing back within {hold_s:.0f} s of a shrink")):
        if out[key]:
            b = out[key]
            print(f"{what}: {b['attainment']:.1%} in {b['worker_hours']:.1f} worker-h, {out[saved]:.1%} fewer; "
                  f"sizes {b['sizes']}")
    for lag, b in out["causal"].items():
        past = "all blocks before" if lag == "0" else f"the {lag} block(s) before"
        if b is None:
            print(f"causal, sized from {past}: never reaches the static split's attainment")
        else:
            print(f"causal, sized from {past}: {b['attainment']:.1%} in {b['worker_hours']:.1f} worker-h, "
                  f"{b['saved']:+.1%} fewer; sizes {b['sizes']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="a trace file or synthetic load, as for pdserve simulate")
    ap.add_argument("--workers", type=int, default=64, help="scale the trace to load about this many workers")
    ap.add_argument("--block-s", type=float, default=300.0, help="how often the hindsight schedule may change")
    ap.add_argument("--vary", choices=("prefill", "decode"), default="prefill",
                    help="the pool the schedule sizes; the other stays at the best static split's size")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--hold-s", type=float, default=600.0,
                    help="for the steady bound: no pool grows within this long of shrinking (the issue's 10 minutes)")
    ap.add_argument("--grid", type=int, default=40,
                    help="pool sizes tried per block, up to 3x the static split's (at 512 workers, 40 steps by 25)")
    ap.add_argument("--split", help="the best static split as P:D, when known (skips the search)")
    ap.add_argument("--out", default=str(OUT / "planner_bound.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    unbounded = PoolLimits(max_replicas=1 << 20)
    planner = PlannerSection(mode="sla", profile=str(default_profile()), prefill=unbounded, decode=unbounded,
                             target_attainment=args.target)
    base = SimSettings(profile=StepCostModel.load(default_profile()), decode_profile=None, mode="disaggregated",
                       budget=2048, routing="prefix_aware", seed=0)
    settings = settings_from(planner, base)
    reqs = parse_trace(args.trace)
    reqs, _ = scale_to_workers(reqs, settings, args.target, args.workers)
    if args.split:  # the search's answer from an earlier run (at 512 workers it takes ~10 minutes)
        given = parse_split(args.split, flag="--split")
        static = {**simulate(reqs, settings, StaticPlanner(given), given)[1], "split": given}
    else:
        static = best_static(reqs, settings, args.target, sized_split(reqs, settings, args.target, cheapest=True),
                             cache={})
    split = static["split"]
    other = "decode" if args.vary == "prefill" else "prefill"
    blocks, starts, spans = split_blocks(reqs, args.block_s)
    curves = block_curves(blocks, settings, args.vary, {other: split[other]}, 3 * split[args.vary], args.grid)
    bound = cheapest(curves, spans, split[other], len(reqs), static["attainment"])
    exact = optimum(curves, starts, spans, split[other], len(reqs), static["attainment"])
    steady = optimum(curves, starts, spans, split[other], len(reqs), static["attainment"], args.hold_s)
    counts = [len(b) for b in blocks]
    causal = {lag: lagged(curves, counts, spans, split[other], len(reqs), static["attainment"], split[args.vary], lag)
              for lag in LAGS}
    # The static split on the same accounting (blocks' spans, no drain after the last arrival).
    static_h = (split["prefill"] + split["decode"]) * sum(spans)
    out = {"trace": args.trace, "workers": args.workers, "block_s": args.block_s, "vary": args.vary,
           "requests": len(reqs), "best_static": {k: static[k] for k in ("split", "attainment", "worker_hours")},
           "best_static_block_hours": static_h, "bound": bound,
           "most_saved": 1 - bound["worker_hours"] / static_h if bound else None,
           "exact": exact, "most_saved_exact": 1 - exact["worker_hours"] / static_h if exact else None,
           "hold_s": args.hold_s, "bound_steady": steady,
           "most_saved_steady": 1 - steady["worker_hours"] / static_h if steady else None,
           # Keyed by how many blocks before each one it learns from ("0": all of them).
           "causal": {str(lag): {**got, "saved": 1 - got["worker_hours"] / static_h} if got else None
                      for lag, got in causal.items()},
           "wall_s": time.perf_counter() - t0}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    report(out, static)
    print(f"wrote {path} ({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
