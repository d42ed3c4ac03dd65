"""What a simulation run reports: SLO attainment, goodput, worker-hours, latency percentiles,
and how the pools moved (reversals, and scale-downs undone within ten minutes)."""

from __future__ import annotations

import statistics

from pdserve.sim.cluster import SimResult, percentile, worker_hours

OSCILLATION_WINDOW_S = 600.0


def met_ttft(req) -> bool:
    return req.finish is not None and req.first - req.arrival <= req.ttft_slo


def met_tpot(req) -> bool:
    return req.finish is not None and (req.output_len <= 1
                                       or (req.finish - req.first) / (req.output_len - 1) <= req.tpot_slo)


def met(req) -> bool:
    return met_ttft(req) and met_tpot(req)


def summarize(result: SimResult, max_profiled_tokens: int) -> dict:
    reqs = result.requests
    n = len(reqs)
    span = (reqs[-1].arrival - reqs[0].arrival) if n > 1 else 1.0
    good = sum(met(r) for r in reqs)
    done = [r for r in reqs if r.finish is not None]
    ttft = [r.first - r.arrival for r in done]
    tpot = [(r.finish - r.first) / (r.output_len - 1) for r in done if r.output_len > 1]
    queue = [r.queue_s for r in done]
    return {
        "requests": n,
        "unfinished": n - len(done),
        "rejected": sum(r.rejected for r in reqs),
        "attainment": good / n if n else 0.0,
        # Each SLO alone: which pool the misses come from.
        "ttft_attainment": sum(met_ttft(r) for r in reqs) / n if n else 0.0,
        "tpot_attainment": sum(met_tpot(r) for r in reqs) / n if n else 0.0,
        "goodput": good / span,
        "throughput": len(done) / span,
        "worker_hours": worker_hours(result),
        "duration_s": span,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p90_s": percentile(tpot, 0.9),
        "queue_p90_s": percentile(queue, 0.9),
        "mean_prompt_tokens": statistics.fmean(r.prompt_len for r in reqs) if reqs else 0.0,
        "mean_output_tokens": statistics.fmean(r.output_len for r in reqs) if reqs else 0.0,
        "extrapolated_share": sum(r.prompt_len > max_profiled_tokens for r in reqs) / n if n else 0.0,
        **movement(result),
    }


def movement(result: SimResult) -> dict:
    """Direction reversals per hour, and scale-downs followed by a scale-up of the same pool
    within OSCILLATION_WINDOW_S (the planner's no-oscillation criterion)."""
    changes: dict[str, list[tuple[float, int]]] = {}
    for d in result.decisions:
        for pool, want in d.desired.items():
            have = d.current.get(pool, 0)
            if want != have:
                changes.setdefault(pool, []).append((d.at_s, 1 if want > have else -1))
    reversals = oscillations = 0
    for moves in changes.values():
        for (t0, s0), (t1, s1) in zip(moves, moves[1:], strict=False):
            if s0 != s1:
                reversals += 1
                if s0 < 0 < s1 and t1 - t0 < OSCILLATION_WINDOW_S:
                    oscillations += 1
    hours = max(result.end_s / 3600.0, 1e-9)
    peak = {}
    for _, counts in result.timeline:
        for pool, c in counts.items():
            peak[pool] = max(peak.get(pool, 0), c)
    return {"scale_events": sum(len(m) for m in changes.values()), "reversals_per_hour": reversals / hours,
            "oscillations": oscillations, "peak_replicas": peak}
