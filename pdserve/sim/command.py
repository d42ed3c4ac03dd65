"""`pdserve simulate`: replay a trace through the simulated cluster, planner against the best
static split (or one given split), and write JSON plus a PNG of replicas over time."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from pdcommon.config import PlannerSection, PoolLimits, load_config
from pdcommon.step_cost import StepCostModel
from pdserve.sim import traces
from pdserve.sim.cluster import SimSettings
from pdserve.sim.search import compare, lengths, mean_rate, scale_to_workers, scale_trace, settings_from, simulate
from router.planner import StaticPlanner

DEFAULT_PROFILE = "llama-50m.json"  # the benchmark model, 1 thread per worker, ZeroMQ transfer


def default_profile() -> Path:
    return Path(str(resources.files("pdserve.sim") / "profiles" / DEFAULT_PROFILE))


def parse_trace(spec: str, seed: int = 0) -> list[traces.TraceRequest]:
    """A trace file (Azure CSV, Mooncake JSON lines) or a synthetic load:
    poisson:rate=R,n=N[,prompt=P,output=O,spread=F]; bursty:...,cv=C;
    diurnal:rate=R,duration=S[,period=S,amplitude=A,...]."""
    kind, _, params = spec.partition(":")
    if kind not in ("poisson", "bursty", "diurnal"):
        return traces.load_trace(spec)
    kv = {k: float(v) for k, v in (p.split("=", 1) for p in params.split(",") if p)}
    common = {"prompt_len": int(kv.pop("prompt", 512)), "output_len": int(kv.pop("output", 64)),
              "range_ratio": kv.pop("spread", 0.0), "seed": seed}
    try:
        if kind == "diurnal":
            return traces.diurnal(kv.pop("rate"), kv.pop("duration"), period_s=kv.pop("period", 3600.0),
                                  amplitude=kv.pop("amplitude", 0.8), **common)
        extra = {"cv": kv.pop("cv")} if kind == "bursty" and "cv" in kv else {}
        reqs = getattr(traces, kind)(kv.pop("rate"), int(kv.pop("n")), **extra, **common)
    except KeyError as e:
        raise ValueError(f"--trace {spec}: missing {e.args[0]}=") from None
    if kv:
        raise ValueError(f"--trace {spec}: unknown parameters {sorted(kv)}")
    return reqs


def _settings(args, profile: StepCostModel, decode: StepCostModel | None) -> tuple[SimSettings, PlannerSection]:
    if args.config:
        cfg = load_config(args.config)
        planner = cfg.planner.model_copy(update={"mode": "sla"})
        role = cfg.roles[0]
        budget = cfg.engine_config(role).max_num_batched_tokens
        mode, routing = cfg.mode, cfg.router.routing
    else:
        # No config: no replica caps but the trace's own (a simulation may run thousands).
        unbounded = PoolLimits(max_replicas=1 << 20)
        planner = PlannerSection(mode="sla", profile=str(args.profile or default_profile()), prefill=unbounded,
                                 decode=unbounded)
        budget, mode, routing = 2048, args.mode, "prefix_aware"
    slos = {k: v / 1e3 for k, v in (("ttft_slo_s", args.slo_ttft_ms), ("tpot_slo_s", args.slo_tpot_ms)) if v}
    if slos:
        planner = planner.model_copy(update=slos)
    scales = [float(x) for x in args.step_scale.split(",")] if args.step_scale else [1.0, 1.0]
    base = SimSettings(profile=profile, decode_profile=decode, mode=args.mode or mode, budget=budget,
                       routing=args.routing or routing, seed=args.seed, prefill_scale=scales[0],
                       decode_scale=scales[-1], seq_overhead_s=(args.seq_overhead_ms or 0.0) / 1e3)
    return settings_from(planner, base), planner


def run(args, say: Callable[[str], None] | None = None) -> dict:
    t0 = time.perf_counter()
    prof_path = Path(args.profile) if args.profile else default_profile()
    profile = StepCostModel.load(prof_path)
    decode = StepCostModel.load(args.decode_profile) if args.decode_profile else None
    settings, planner = _settings(args, profile, decode)
    reqs = parse_trace(args.trace, args.seed)
    if args.duration:
        reqs = [r for r in reqs if r.arrival_s < args.duration]
    factor = args.scale or 1.0
    if args.workers:
        reqs, factor = scale_to_workers(reqs, settings, planner.target_attainment, args.workers, args.seed)
    elif factor != 1.0:
        reqs = scale_trace(reqs, factor, args.seed)
    info = {"source": args.trace, "requests": len(reqs), "duration_s": reqs[-1].arrival_s - reqs[0].arrival_s,
            "mean_rate": mean_rate(reqs), "scale_factor": factor, **lengths(reqs),
            "beyond_profile_share": sum(r.prompt_len > profile.max_profiled_tokens for r in reqs) / len(reqs)}
    out = {"trace": info, "profile": str(prof_path), "decode_profile": args.decode_profile, "mode": settings.mode,
           "slos": {"ttft_s": planner.ttft_slo_s, "tpot_s": planner.tpot_slo_s,
                    "ttft_factor": planner.ttft_slo_factor, "tpot_factor": planner.tpot_slo_factor},
           "planner_config": planner.model_dump()}
    if args.static:
        split = parse_split(args.static, settings.roles)
        _, out["static"] = simulate(reqs, settings, StaticPlanner(split), split)
        out["static"]["split"] = split
    else:
        out.update(compare(reqs, settings, planner, say=say))
    out["wall_s"] = time.perf_counter() - t0
    return out


def parse_split(text: str, roles: tuple[str, ...] = ("prefill", "decode"), flag: str = "--static",
                ) -> dict[str, int]:
    """A split written as `P:D` (or `C` colocated), one count per role."""
    parts = [int(x) for x in text.split(":")]
    if len(parts) != len(roles):
        raise ValueError(f"{flag} wants {':'.join(r.upper()[0] for r in roles)} for this mode, got {text!r}")
    return dict(zip(roles, parts, strict=True))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    timeline = out.get("planner_replicas", [])
    split = out["best_static"]["split"]
    for pool, color in (("prefill", "tab:blue"), ("decode", "tab:orange"), ("colocated", "tab:green")):
        if timeline and pool in timeline[0][1]:
            xs = [t / 60 for t, _ in timeline]
            ax.step(xs, [c[pool] for _, c in timeline], where="post", color=color, label=f"planner: {pool}")
        if pool in split:
            ax.axhline(split[pool], color=color, ls="--", alpha=0.6, label=f"best static: {pool} = {split[pool]}")
    p, s = out["planner"], out["best_static"]
    ax.set(xlabel="simulated minutes", ylabel="workers",
           title=f"{Path(out['trace']['source']).name} x{out['trace']['scale_factor']:.1f}: planner "
                 f"{p['attainment']:.1%} in {p['worker_hours']:.1f} worker-h; best static {s['attainment']:.1%} "
                 f"in {s['worker_hours']:.1f} worker-h")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _met(s: dict) -> str:
    """Both SLOs, then each alone: which pool the misses come from."""
    return f"{s['attainment']:.1%} (TTFT {s['ttft_attainment']:.1%}, TPOT {s['tpot_attainment']:.1%})"


def main(args) -> int:
    out = run(args, say=lambda line: print(line, file=sys.stderr, flush=True))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    if "static" in out:
        s = out["static"]
        print(f"static {s['split']}: attainment {_met(s)}, goodput {s['goodput']:.2f} req/s, "
              f"TTFT p50/p90 {s['ttft_p50_s'] * 1e3:.0f}/{s['ttft_p90_s'] * 1e3:.0f} ms, "
              f"TPOT p50/p90 {s['tpot_p50_s'] * 1e3:.1f}/{s['tpot_p90_s'] * 1e3:.1f} ms")
    else:
        png = Path(args.png) if args.png else path.with_suffix(".png")
        plot(out, png)
        for name in ("planner", "best_static"):
            s = out[name]
            print(f"{name:11s}: attainment {_met(s)}, goodput {s['goodput']:.2f} req/s, "
                  f"{s['worker_hours']:.2f} worker-h, peak {s['peak_replicas']}"
                  + (f", split {s['split']}" if "split" in s else f", {s['oscillations']} oscillations, "
                     f"{s['reversals_per_hour']:.1f} reversals/h"))
        same = out["best_static_same_attainment"]
        if same.get("split") != out["best_static"].get("split"):
            print(f"best static at the planner's attainment: {same['attainment']:.1%} in {same['worker_hours']:.2f} "
                  f"worker-h, split {same['split']}; the planner saves "
                  f"{out['worker_hours_saved_same_attainment']:.1%} against it")
        print(f"worker-hours saved by the planner: {out['worker_hours_saved']:.1%}; wrote {path} and {png}")
    print(f"({out['trace']['requests']} requests, scale x{out['trace']['scale_factor']:.2f}, {out['wall_s']:.0f} s)")
    return 0
