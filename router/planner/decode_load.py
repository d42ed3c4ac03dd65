"""What the decode pool's load asks of it, from the profile: tokens per second a worker makes at
most, the fewest workers that keep up, whether a block saturated the pool, and the TPOT the
profile predicts for requests as they were served (the SLA planner's decode correction)."""

from __future__ import annotations

import math
import statistics

from pdcommon.step_cost import StepCostModel
from router.planner.base import Finished, Observation

SATURATED, MAX_BATCH = 0.8, 256  # decode demand over capacity past which a block teaches nothing


def predicted_tpot(prof: StepCostModel, multi: list[Finished], worker_seconds: float, tpot: float) -> float:
    """The profile's mean TPOT for these requests (under load too: a stack slower per token
    than the profile, the live router's with Python between the engine and the client, is
    only seen there, and a model that predicts every TPOT met is not moved by any attainment
    offset)."""
    if all(f.batch for f in multi):
        # At the batch each rode, as its decode worker counted it. Guessed instead (below), it
        # read the profile as fast: at light load the router's least-loaded placement lets
        # most sequences decode alone, which `1 + batch` does not count, and the 0.88 learnt
        # there made the model optimistic at the TPOT knee (bench/decode_model.py: 1.000
        # predicted where 0.501 was served); a diurnal load met 87.5% of a 90% target.
        return statistics.fmean(prof.itl_seconds(f.batch, f.prompt_len + f.output_len / 2)
                                + prof.transfer_seconds(f.prompt_len) / (f.output_len - 1) for f in multi)
    # A worker that does not say (an older one): by Little's law from what the requests saw,
    # itself and, on average, the pool's mean.
    outs = statistics.fmean(f.output_len for f in multi)
    ctx = round(statistics.fmean(f.prompt_len + f.output_len / 2 for f in multi))
    batch = len(multi) / worker_seconds * outs * tpot
    xfer = statistics.fmean(prof.transfer_seconds(f.prompt_len) / (f.output_len - 1) for f in multi)
    return prof.itl_seconds(1.0 + batch, ctx) + xfer


def capacity(prof: StepCostModel, ctx: float) -> float:
    """Decode tokens per second one worker makes at most: a step of as many sequences of
    context `ctx` as its KV holds (at most MAX_BATCH)."""
    ctx = max(round(ctx), 1)
    batch = min(MAX_BATCH, max((prof.kv_capacity_tokens or MAX_BATCH * ctx) // ctx, 1))
    return batch / prof.itl_seconds(batch, ctx)


def floor_workers(prof: StepCostModel, obs: Observation) -> int:
    """The fewest decode workers that keep up with the decode tokens this interval's arrivals
    ask for, each at its most tokens per second (capacity): fewer fall behind
    whatever their TPOT. The queueing model sizes from the forecast rate and the sample's
    mean output, both of which lag a change of mix: in the live test an output-heavy phase
    (12 req/s x 64 tokens, 1.5x one worker's capacity) followed prompt-only traffic, and
    with a rate planned at 6-8 and one-token outputs still in the sample the model kept
    one decode worker, every request of the phase missing its TPOT."""
    multi = [a for a in obs.arrivals if a.output_len > 1]
    if not multi or obs.duration_s <= 0:
        return 1
    asked = sum(a.output_len - 1 for a in multi) / obs.duration_s
    ctx = statistics.fmean(a.prompt_len + a.output_len / 2 for a in multi)
    return max(1, math.ceil(asked / capacity(prof, ctx)))


def saturated(prof: StepCostModel, obs: Observation, multi: list[Finished], current: dict[str, float]) -> bool:
    """Whether the block asked more decode tokens per second of the pool than SATURATED of
    what the profile says it makes at its largest batch (as many sequences as the KV holds).
    Past that, sequences wait for room and their TPOT is mostly that wait, which neither the
    correction (a per-token speed) nor the attainment offset (the model's bias at steady
    state) should learn: in the live test, an output-heavy burst on one decode worker taught
    a 2.8x correction that then held three decode workers through the idle minute after it.
    (Blocks served while the pool was growing still teach: leaving them out as well cost the
    Azure code trace 5 points of TPOT attainment in the simulator.)"""
    if not multi:  # the block's finished requests with decode steps
        return False
    ctx = statistics.fmean(f.prompt_len + f.output_len / 2 for f in multi)
    most = capacity(prof, ctx) * max(current.get("decode", 0), 1.0)
    # What arrived as well as what finished: a saturated pool finishes only what it can.
    asked = sum(max(a.output_len - 1, 0) for a in obs.arrivals)
    demand = max(sum(f.output_len - 1 for f in multi), asked) / obs.duration_s
    return demand > SATURATED * most
