"""The SLA planner: pools sized each interval so that a target share of requests meet both SLOs.

Each interval it
1. forecasts the request rate at the time a change would take effect (interval + start-up);
2. sizes the prefill pool by replaying recent arrivals (router/planner/replay.py) and the decode
   pool from ITL and KV capacity (router/planner/sizing.py), over a sample of recent requests,
   so that the prediction covers the length mix and its bursts, not only their means, and
   splits the misses the target allows between the pools where they cost fewest workers;
3. corrects the profile with what it observed: prefill time as served (TTFT less queue time)
   over the profile's, and TPOT over the profile's ITL at the batch Little's law implies;
4. applies the policy: scale up at once; scale down slowly (see PlannerSection), so that a
   dip in load does not take away workers the next minute needs back.

Both SLOs must hold for `target_attainment` of requests over `attainment_window_s` (an error
budget: `_aim` plans an interval lower while the window has met more than the target): the
pools' goals multiply to the planned attainment (`_joint`), with the misses shared between them
as the fewest workers in all need.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from pdcommon.config import PlannerSection
from pdcommon.step_cost import StepCostModel
from router.planner import decode_load
from router.planner.arrivals import arrival_cv2, burst_rate
from router.planner.base import Arrival, Decision, Observation
from router.planner.forecast import FORECASTERS
from router.planner.scale_policy import POOLS, ScalePolicy
from router.planner.sizing import PoolModel, Slos, Terms

log = logging.getLogger(__name__)

# Recent arrivals kept for the length mix and the prefill replay: the stretch the forecast
# measured (_age_sample), which this only caps. The replay compresses the sample by the forecast
# rate over the sample's own, which is right only if both cover the same stretch. Capped at
# 4096, at 512 workers (~40 requests/s) it held the last 100-270 s of a 10-minute stretch: on
# the Azure code trace, one burst inside it was replayed at 1.9x its size (the stretch's rate
# over the sample's), when the load had already fallen to 2 requests/s, and grew the pools to
# 515 prefill and 184 decode workers (best static split: 365 + 122).
SAMPLE = 32768
SAMPLE_MIN, SAMPLE_AGE_INTERVALS = 128, 4
CORRECTION_RANGE = (0.5, 4.0)
OFFSET_LIMIT = 0.3
# The offset is a model's bias, which drifts slowly, while one block's attainment swings with
# its few dozen requests (a burst of long contexts): it is the median misfit of the last
# OFFSET_BLOCKS blocks, shrunk toward zero by OFFSET_PRIOR requests' worth of "no bias" until
# many requests agree. Moved 30% by each block, one bad block of 30 requests grew the Mooncake
# decode pool from 33 to 72 workers a minute after the burst had passed. A mean weighed by
# requests, faded 0.9 a block, still let one: at 512 workers the Azure code trace's burst block
# (2,000 requests, 48% met where 99% was predicted) taught -0.20, which held the prefill model
# untrusted for half an hour and grew the pool to 696 (static: 365).
OFFSET_BLOCKS, OFFSET_PRIOR = 5, 200.0
DISTRUST = 0.02  # an attainment offset below this: the model is optimistic; ignore its diminishing returns
PAID_GROWTH, PAID_GAIN = 1.3, 0.01  # a pool grown this much that gained less attainment: growth did not pay
GOAL_RANGE = (0.5, 0.99)
# The joint target is met when the two pools' attainments multiply to it (misses of the two
# kinds are about independent): which pool takes more of the misses is chosen each interval
# from these shares of them, as the split that needs the fewest workers. Half each (the old
# fixed rule) asked the Azure code trace's prefill pool for 95% TTFT through its bursts, where
# the best fixed split meets 92% TTFT and 97% TPOT.
MISS_SHARES = (0.5, 0.4, 0.6, 0.3, 0.7, 0.2, 0.8, 0.1, 0.9)  # the even split first: it wins ties
LIGHT_LOAD = 0.5  # utilization under which observed latency corrects the profile
# The error budget (_aim) lowers the planned attainment once the window holds this many finished
# requests, at most this far below the target.
BUDGET_MIN_REQUESTS, BUDGET_MAX_SPEND = 200, 0.3
# The load is rising when the arrivals of the last quarter of the scale-down window exceed those
# of the quarter before by this many Poisson standard errors (see ScalePolicy.decide, `rising`).
RISE_Z = 3.0
# The prefill correction is this quantile of a light block's served / profiled prefill times: a
# prompt that shared its steps with others was served for theirs too. See _correct.
ALONE_QUANTILE = 0.25


class SlaPlanner:
    name = "sla"

    def __init__(self, cfg: PlannerSection, profile: StepCostModel, decode_profile: StepCostModel | None = None,
                 chunk: int | None = None) -> None:
        self.cfg = cfg
        slos = Slos(cfg.ttft_slo_s, cfg.tpot_slo_s, cfg.ttft_slo_factor, cfg.tpot_slo_factor)
        # Both see the sample as the router does: requests too big for a decode worker's KV refused.
        max_kv = (decode_profile or profile).kv_capacity_tokens
        self.prefill_model = PoolModel(profile, slos, chunk, max_kv_tokens=max_kv)
        self.decode_model = PoolModel(decode_profile or profile, slos, chunk, max_kv_tokens=max_kv)
        self.forecaster = FORECASTERS[cfg.forecaster]()
        self.sample: deque[Arrival] = deque(maxlen=SAMPLE)
        self.correction = {"prefill": 1.0, "decode": 1.0}
        # Observed minus predicted SLO attainment per pool at the replicas that served it: where
        # the queueing and batching models are off (they are approximations), aim that much lower
        # or higher.
        self.offset = {"prefill": 0.0, "decode": 0.0}
        self.offset_blocks = {p: deque(maxlen=OFFSET_BLOCKS) for p in POOLS}  # (misfit, requests) per block
        # Per pool, what the last two measured blocks saw: (start, replicas, observed attainment).
        self.seen: dict[str, deque[tuple[float, float, float]]] = {p: deque(maxlen=2) for p in POOLS}
        self.policy = ScalePolicy(cfg)
        self.share = 0.5  # of the misses, the prefill pool's (MISS_SHARES), as last chosen
        self.hit_fraction = 0.0
        self.prev_rate = 0.0
        # Intervals not yet in a block: (observation, replicas, requests waiting when it began).
        self.pending: list[tuple[Observation, dict[str, int], int]] = []
        self.backlog = 0  # requests with no first token yet at the end of the last interval
        self.met_sums = (0.0, 0.0)  # (met, ended: finished or failed), faded over the attainment window
        self.aim = cfg.target_attainment  # what this interval plans for (_aim)
        self.arrived: deque[tuple[float, int]] = deque()  # (interval end, arrivals) for _rising

    def _age_sample(self, now: float) -> None:
        """The length mix of the stretch the forecast measured (at least SAMPLE_MIN arrivals),
        or of the last SAMPLE_AGE_INTERVALS intervals for a forecaster without one: a steady
        load is planned from minutes of its mix (a heavy-tailed one needs that many), and a
        load that changes must not be planned for with the old shape."""
        since = self.forecaster.since()
        horizon = since if since is not None else now - SAMPLE_AGE_INTERVALS * self.cfg.interval_s
        # An arrival at time 0.0 is timed too: read as `at_s or now`, it passed for an untimed
        # one, which is never aged, and held every later one in the sample until 4096 had come
        # (the simulator's traces start at 0.0; the router's monotonic clock never reads it).
        while len(self.sample) > SAMPLE_MIN and (now if self.sample[0].at_s is None else self.sample[0].at_s) < horizon:
            self.sample.popleft()

    def _aim(self, obs: Observation) -> float:
        """The attainment this interval plans for. The target is a share of the requests over
        the attainment window (an error budget), not of every interval's: what the window has
        met above the target (plus a margin) is spent by planning that much lower. Planned for
        the target interval by interval, the pools meet it with room in most intervals (the
        Mooncake trace met 91.8% over its hour). A shortfall is not made up by planning above
        the target: the misses of an overload (a burst, a pool still starting) come from the
        size the pool was, and aiming higher afterwards buys workers for load already gone."""
        cfg = self.cfg
        fade = math.exp(-obs.duration_s / cfg.attainment_window_s) if cfg.attainment_window_s > 0 else 0.0
        met, seen = self.met_sums
        # The failed count as misses: left out, the 2.2% of the Mooncake trace too big for a
        # worker's KV read as met, and the budget spent them (91.3% seen, 89.9% reached).
        met, seen = fade * met + sum(f.met for f in obs.finished), fade * seen + len(obs.finished) + obs.failed
        self.met_sums = (met, seen)
        if cfg.attainment_window_s <= 0 or seen < BUDGET_MIN_REQUESTS:
            return cfg.target_attainment
        surplus = max(met / seen - cfg.target_attainment - cfg.attainment_margin, 0.0)
        return max(cfg.target_attainment - cfg.attainment_gain * surplus, cfg.target_attainment - BUDGET_MAX_SPEND)

    def request_slos(self, prompt_len: int, output_len: int) -> tuple[float, float]:
        pm, dm = self.prefill_model, self.decode_model
        return (pm.slos.ttft(pm.profile, prompt_len, 0, pm.chunk), dm.slos.tpot(dm.profile, prompt_len, output_len))

    # ---- one interval ---------------------------------------------------------------------
    def plan(self, obs: Observation, current: dict[str, int]) -> Decision:
        cfg, now = self.cfg, obs.end_s
        self.forecaster.observe(now, obs.rate)
        self.aim = self._aim(obs)
        self.sample.extend(obs.arrivals)
        self._age_sample(now)
        if obs.prompt_tokens:
            self.hit_fraction = 0.5 * self.hit_fraction + 0.5 * obs.cached_tokens / obs.prompt_tokens
        cv2 = arrival_cv2(self.sample)
        self.prefill_model.arrival_cv2 = self.decode_model.arrival_cv2 = cv2
        sample = [Arrival(a.prompt_len, a.output_len, int(self.hit_fraction * a.prompt_len), a.at_s)
                  for a in self.sample]
        # The forecast's rate; bursts inside it are in the sample's arrival times, which the
        # prefill replay keeps (router/planner/replay.py), and decode plans for the rate its
        # requests meet in them, scaled as the replay is.
        rate = self.forecaster.predict(now + cfg.interval_s + cfg.startup_s)
        since = self.forecaster.since()
        pt, dt = self.prefill_model.terms(sample, since, backlog=obs.waiting), self.decode_model.terms(sample)
        timed = [a.at_s for a in sample if a.at_s is not None]
        burst = burst_rate(timed, since if since is not None else now - cfg.interval_s, now)
        scale = rate / pt.own_rate if pt.own_rate > 0 else 1.0
        decode_rate = max(rate, burst * scale)
        self.decode_model.hold_s = self.correction["prefill"] * pt.service_mean
        block = self._block(obs, current)
        if block is not None:
            # The plan before this block teaches anything: a pool it finds short of the block's
            # load missed for its size, which the plan already fixes, not for the model's bias.
            short = {p: n > block[1].get(p, 0) for p, n in self._size(rate, decode_rate, pt, dt).items()}
            self._correct(*block, pt, dt, short)
        need = self._size(rate, decode_rate, pt, dt)
        floor = decode_load.floor_workers(self.decode_model.profile, obs)
        need["decode"] = max(need["decode"], floor)
        relaxed = self._relaxed(rate, decode_rate, pt, dt, floor)
        trusted = {p: self._trust(p) for p in POOLS}  # as this plan was sized, before the policy's change
        keep_up = {"prefill": self.prefill_model.prefill_keep_up(rate, pt, self.correction["prefill"]),
                   "decode": floor}
        rising = self._rising(obs)
        desired, reasons = self.policy.decide(now, current, need, relaxed, keep_up, self._missing(obs), rising)
        # rate_replayed: the replayed arrivals' own rate, which the prefill replay compresses to
        # rate_planned (their ratio is how much denser than seen the plan assumes the load).
        inputs = {"rate_observed": obs.rate, "rate_burst": burst, "rate_planned": rate, "rate_decode": decode_rate,
                  "rate_replayed": pt.own_rate,
                  "decode_floor": floor, "sample": len(self.sample), "miss_share_prefill": self.share,
                  "arrival_cv2": cv2, "prefix_hit_fraction": self.hit_fraction, "arrivals_rising": rising,
                  "attainment_observed": obs.attainment(), "attainment_planned": self.aim,
                  "attainment_window": self.met_sums[0] / self.met_sums[1] if self.met_sums[1] else None,
                  "correction": dict(self.correction),
                  "attainment_offset": dict(self.offset), "model_trusted": trusted,
                  "predicted": self._predict(rate, decode_rate, desired, pt, dt)}
        decision = Decision(now, dict(current), desired, need, reasons, inputs)
        log.info("planner decision", extra={"decision": decision.to_dict()})
        return decision

    def _relaxed(self, rate: float, decode_rate: float, pt: Terms, dt: Terms, floor: int) -> dict[str, int]:
        """What the pools would need at a higher load: the record a scale-down must stay above.
        A scale-down also needs confidence that the load fell: the planned rate plus two
        Poisson standard errors, so that a quiet interval at low rates (a handful of arrivals)
        does not shed a worker the next one needs back. The error is the rate's over a
        quarter of the scale-down window, not over one interval: the window's highest plan
        is kept anyway, and the maximum of 20 one-interval margins would count noise twice.
        The window's maximum, the noise and the hysteresis are the whole margin: a forecast
        600 s ahead (the trend's slope x 600 s, mostly noise at a few arrivals per interval)
        and a goal tightened for shrinking came on top, and kept the pools 1.3-1.9x what the
        load needed on the Mooncake trace."""
        cfg = self.cfg
        noise = 2 * math.sqrt(rate / max(cfg.interval_s, cfg.scale_down_window_s / 4))
        grow = (rate + noise) * (1 + cfg.hysteresis) / rate if rate > 0 else 1.0
        relaxed = self._size(rate * grow, decode_rate * grow, pt, dt)
        relaxed["decode"] = max(relaxed["decode"], floor)
        return relaxed

    def _rising(self, obs: Observation) -> bool:
        """Whether the last quarter of the scale-down window had more arrivals than the quarter
        before, by more than RISE_Z Poisson standard errors (False until both were seen)."""
        span = self.cfg.scale_down_window_s / 4
        if span <= 0:
            return False
        self.arrived.append((obs.end_s, len(obs.arrivals)))
        while self.arrived[0][0] <= obs.end_s - 2 * span:  # never the interval just appended
            self.arrived.popleft()
        if self.arrived[0][0] > obs.end_s - 2 * span + obs.duration_s:
            return False
        recent = sum(n for t, n in self.arrived if t > obs.end_s - span)
        before = sum(n for t, n in self.arrived if t <= obs.end_s - span)
        return recent - before > RISE_Z * math.sqrt(recent + before)

    def _missing(self, obs: Observation) -> dict[str, bool]:
        """Per pool, whether the requests that ended in the interval met its SLO less often than
        this interval's goal for it (failed requests missed both)."""
        ended = len(obs.finished) + obs.failed
        if not ended:
            return {p: obs.waiting > 0 for p in POOLS}  # nothing ended: only a queue says it is short
        met = {"prefill": sum(f.met_ttft for f in obs.finished), "decode": sum(f.met_tpot for f in obs.finished)}
        return {p: met[p] / ended < self.goal(p, self.share) for p in POOLS}

    def goal(self, pool: str, share: float = 0.5, joint: float | None = None) -> float:
        """The share of what a pool can reach that its model must predict when it takes `share`
        of the misses: the two multiply to `joint` (by default this interval's planned
        attainment, `_aim`), less the offset
        seen between observed and predicted attainment (a pessimistic model asks for less)."""
        lo, hi = GOAL_RANGE
        mine = share if pool == "prefill" else 1 - share
        return min(max((joint or self.aim) ** mine - self.offset[pool], lo), hi)

    def _joint(self, pt: Terms, dt: Terms) -> float:
        """What the pools' goals must multiply to. Each goal is a share of what its pool can
        reach, which leaves out the requests refused (too big for a worker's KV: misses of both
        pools, the same ones) and those that miss on their own however many workers there are;
        taken as a plain product, the goals then met 88.6% against a 90% target on Mooncake.
        Joint attainment is kept x (a_p / kept) x (a_d / kept) for pool attainments a."""
        reach_p = self.prefill_model.prefill_reachable(pt, self.correction["prefill"])
        reach_d = self.decode_model.decode_reachable(dt, self.correction["decode"])
        if reach_p <= 0 or reach_d <= 0:
            return self.aim
        return min(self.aim * pt.kept / (reach_p * reach_d), GOAL_RANGE[1] ** 2)

    def _trust(self, pool: str) -> bool:
        """Whether the model's diminishing returns may stop a pool's growth. Not when observation
        says the model is optimistic, except when that says nothing about more workers: the
        offset was measured before the last change took effect (growing again on it would
        chase the same evidence twice), or the last growth it drove bought no attainment (the
        misses are ones more workers do not save)."""
        if self.offset[pool] > -DISTRUST:
            return True
        seen = self.seen[pool]
        if not seen or seen[-1][0] < self.policy.last_change[pool] + self.cfg.startup_s:
            return True
        if len(seen) == 2:
            (_, before, got_before), (_, after, got_after) = seen
            if after >= PAID_GROWTH * before and got_after - got_before < PAID_GAIN:
                return True
        return False

    def _size(self, rate: float, decode_rate: float, pt: Terms, dt: Terms) -> dict[str, int]:
        """The split of the misses (MISS_SHARES) that needs the fewest workers in all."""
        lim = self.cfg
        trust = {p: self._trust(p) for p in POOLS}
        joint = self._joint(pt, dt)
        best = None
        for share in MISS_SHARES:
            p = self.prefill_model.prefill_workers(rate, pt, self.goal("prefill", share, joint),
                                                   self.correction["prefill"], limit=lim.prefill.max_replicas,
                                                   trust=trust["prefill"])
            d = self.decode_model.decode_workers(decode_rate, dt, self.goal("decode", share, joint),
                                                 self.correction["decode"], limit=lim.decode.max_replicas,
                                                 trust=trust["decode"])
            if best is None or p + d < best[0]:
                best = (p + d, share, {"prefill": p, "decode": d})
        self.share = best[1]
        return best[2]

    def _predict(self, rate: float, decode_rate: float, workers: dict[str, int], pt: Terms,
                 dt: Terms) -> dict[str, float]:
        return {"ttft_attainment": self.prefill_model.prefill_attainment(workers["prefill"], rate, pt,
                                                                         self.correction["prefill"]),
                "tpot_attainment": self.decode_model.decode_attainment(workers["decode"], decode_rate, dt,
                                                                       self.correction["decode"])}

    # ---- observed against predicted --------------------------------------------------------
    def _block(self, obs: Observation, current: dict[str, int],
               ) -> tuple[Observation, dict[str, float], int] | None:
        """Intervals gathered until they hold min_samples finished requests (at low rates one
        interval holds a handful), merged into one observation with the replicas averaged, and
        the backlog the block began with."""
        self.pending.append((obs, dict(current), self.backlog))
        self.backlog = obs.waiting
        if sum(len(o.finished) for o, _, _ in self.pending) < self.cfg.min_samples:
            if obs.end_s - self.pending[0][0].start_s > self.cfg.scale_down_window_s:
                self.pending.pop(0)  # too old to describe the present
            return None
        block, self.pending = self.pending, []
        span = sum(o.duration_s for o, _, _ in block)
        merged = Observation(block[0][0].start_s, block[0][0].start_s + span,
                             [a for o, _, _ in block for a in o.arrivals], [f for o, _, _ in block for f in o.finished],
                             failed=sum(o.failed for o, _, _ in block))
        avg = {p: sum(c.get(p, 0) * o.duration_s for o, c, _ in block) / span for p in POOLS}
        return merged, avg, block[0][2]

    def _correct(self, obs: Observation, current: dict[str, float], carried: int, pt: Terms, dt: Terms,
                 short: dict[str, bool]) -> None:
        """Learn where the profile is off, from steady intervals (the rate within 1.5x of the
        last one) where the pools were lightly loaded: there a request's served time is its
        service time, while under load or after a burst it also holds the wait for other
        prompts in its batch and for the batch's steps, which the queueing model already counts."""
        done = obs.finished
        steady = self.prev_rate > 0 and 2 / 3 <= obs.rate / self.prev_rate <= 1.5
        self.prev_rate = obs.rate
        if not steady:  # a burst's latency is queueing, not the profile
            return
        multi = [f for f in done if f.output_len > 1]
        saturated = decode_load.saturated(self.decode_model.profile, obs, multi, current)
        # A block that began with more prompts waiting than there are prefill workers (a burst's
        # queue, carried in) finishes requests that waited for an earlier load: their TTFTs say
        # nothing of the model's bias at the block's own. The Azure code trace's burst at 15
        # minutes ended such a block at 33% TTFT attainment against ~100% predicted, and the
        # offset it taught (-0.23) held 150-190 prefill workers for 20 minutes (static: 51).
        queued = carried > max(current.get("prefill", 0), 1)
        self._offsets(obs, current, pt, dt, learn={"prefill": not (queued or short["prefill"]),
                                                   "decode": not (saturated or short["decode"])})
        prof_p = self.prefill_model.profile
        chunk = self.prefill_model.chunk
        # Load by what arrived and by what finished: a lull's finishers were served in a burst.
        rate = max(obs.rate, len(done) / obs.duration_s)
        busy = rate * pt.kept * self.correction["prefill"] * pt.service_mean / max(current.get("prefill", 1), 1)
        if busy < LIGHT_LOAD:
            # A prompt that shared its steps with other prompts was served for theirs too (which
            # the replay counts as its wait): the lower quartile's, the requests that ran alone.
            # A light block's mean load can hide a burst within it: on the Azure code trace (its
            # requests come in clusters of seconds) the mean took those for a slow profile
            # (1.2-1.3x), and the median still learned 1.40 from the block after the burst at
            # 14 minutes, which then held 107 prefill workers (static: 52) for a quarter of an hour.
            ratios = sorted(max(f.ttft_s - f.queue_s, 0.0) / p for f in done
                            if (p := prof_p.prefill_seconds(f.prompt_len, 0, chunk)) > 0)
            if ratios:
                self._blend("prefill", ratios[int(ALONE_QUANTILE * (len(ratios) - 1))])
        if not multi or not current.get("decode") or saturated:
            return
        tpot = statistics.fmean(f.tpot_s for f in multi)
        predicted = decode_load.predicted_tpot(self.decode_model.profile, multi,
                                               obs.duration_s * current["decode"], tpot)
        self._blend("decode", tpot / predicted if predicted > 0 else 1.0)

    def _offsets(self, obs: Observation, current: dict[str, float], pt: Terms, dt: Terms,
                 learn: dict[str, bool]) -> None:
        done = obs.finished
        seen = {"prefill": statistics.fmean(f.met_ttft for f in done),
                "decode": statistics.fmean(f.met_tpot for f in done)}
        said = {"prefill": self.prefill_model.prefill_attainment(max(round(current.get("prefill", 0)), 1), obs.rate,
                                                                 pt, self.correction["prefill"]),
                "decode": self.decode_model.decode_attainment(max(current.get("decode", 0), 1.0), obs.rate, dt,
                                                              self.correction["decode"])}
        for pool in POOLS:
            if not learn[pool]:
                continue
            self.seen[pool].append((obs.start_s, current.get(pool, 0), seen[pool]))
            blocks = self.offset_blocks[pool]
            blocks.append((seen[pool] - said[pool], len(done)))
            n = sum(k for _, k in blocks)
            shrunk = statistics.median(m for m, _ in blocks) * n / (n + OFFSET_PRIOR)
            self.offset[pool] = min(max(shrunk, -OFFSET_LIMIT), OFFSET_LIMIT)

    def _blend(self, pool: str, ratio: float) -> None:
        lo, hi = CORRECTION_RANGE
        self.correction[pool] = min(max(0.5 * self.correction[pool] + 0.5 * ratio, lo), hi)
