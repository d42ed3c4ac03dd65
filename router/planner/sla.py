"""The SLA planner: pools sized each interval so that a target share of requests meet both SLOs.

Each interval it
1. forecasts the request rate at the time a change would take effect (interval + start-up);
2. sizes the prefill pool with the queueing model and the decode pool from ITL and KV capacity
   (router/planner/sizing.py), over a sample of recent requests, so that the prediction
   covers the length mix and not only its mean;
3. corrects the profile with what it observed: prefill time as served (TTFT less queue time)
   over the profile's, and TPOT over the profile's ITL at the batch Little's law implies;
4. applies the policy: scale up at once; scale down slowly (see PlannerSection), so that a
   dip in load does not take away workers the next minute needs back.

Both SLOs must hold for `target_attainment` of requests; each pool aims at half the misses
allowed (1 - (1 - target) / 2), which by the union bound meets the joint target.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from pdcommon.config import PlannerSection
from pdcommon.step_cost import StepCostModel
from router.planner.base import Arrival, Decision, Observation
from router.planner.forecast import FORECASTERS
from router.planner.sizing import PoolModel, Slos, Terms

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
SAMPLE = 1024  # recent arrivals kept for the length mix
SAMPLE_MIN, SAMPLE_AGE_INTERVALS = 128, 4
CORRECTION_RANGE = (0.5, 4.0)
BURST_WINDOW_S = 5.0
OFFSET_LIMIT = 0.3
DISTRUST = 0.02  # an attainment offset below this: the model is optimistic; ignore its diminishing returns
PAID_GROWTH, PAID_GAIN = 1.3, 0.01  # a pool grown this much that gained less attainment: growth did not pay
GOAL_RANGE = (0.5, 0.99)
LIGHT_LOAD = 0.5  # utilization under which observed latency corrects the profile
CV2_RANGE = (0.5, 16.0)


def burst_rate(obs: Observation) -> float:
    """The arrival rate a typical request of the interval meets: over BURST_WINDOW_S windows,
    weighted by arrivals (sum c^2 / sum c / W). Poisson arrivals give about the mean; on/off
    bursts give the rate while on, which is what queues build at."""
    times = [a.at_s for a in obs.arrivals if a.at_s is not None]
    n = int(obs.duration_s // BURST_WINDOW_S)
    if n < 2 or not times:
        return obs.rate
    counts = [0] * n
    for t in times:
        counts[min(n - 1, max(0, int((t - obs.start_s) // BURST_WINDOW_S)))] += 1
    seen = sum(c * c for c in counts) / max(sum(counts), 1) / BURST_WINDOW_S
    return max(seen - 1 / BURST_WINDOW_S, obs.rate)  # less the request itself


def arrival_cv2(sample) -> float:
    """Squared coefficient of variation of the gaps between arrivals (1 for Poisson; bursts
    raise it, and with it the queueing model's waits)."""
    times = sorted(a.at_s for a in sample if a.at_s is not None)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if len(gaps) < 20:
        return 1.0
    mean = statistics.fmean(gaps)
    cv2 = statistics.pvariance(gaps) / (mean * mean) if mean > 0 else 1.0
    return min(max(cv2, CV2_RANGE[0]), CV2_RANGE[1])


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
        # Per pool, what the last two measured blocks saw: (start, replicas, observed attainment).
        self.seen: dict[str, deque[tuple[float, float, float]]] = {p: deque(maxlen=2) for p in POOLS}
        self.history: dict[str, deque[tuple[float, int]]] = {p: deque() for p in POOLS}  # scale-down recs
        self.last_change: dict[str, float] = {p: -math.inf for p in POOLS}
        self.per_pool_target = 1 - (1 - cfg.target_attainment) / 2
        self.hit_fraction = 0.0
        self.prev_rate = 0.0
        self.pending: list[tuple[Observation, dict[str, int]]] = []

    def _age_sample(self, now: float) -> None:
        """The length mix of the last SAMPLE_AGE_INTERVALS intervals (at least SAMPLE_MIN
        arrivals): a workload that changes shape must not be planned for with the old shape."""
        horizon = now - SAMPLE_AGE_INTERVALS * self.cfg.interval_s
        while len(self.sample) > SAMPLE_MIN and (self.sample[0].at_s or now) < horizon:
            self.sample.popleft()

    def request_slos(self, prompt_len: int, output_len: int) -> tuple[float, float]:
        pm, dm = self.prefill_model, self.decode_model
        return (pm.slos.ttft(pm.profile, prompt_len, 0, pm.chunk), dm.slos.tpot(dm.profile, prompt_len, output_len))

    # ---- one interval ---------------------------------------------------------------------
    def plan(self, obs: Observation, current: dict[str, int]) -> Decision:
        cfg, now = self.cfg, obs.end_s
        self.forecaster.observe(now, obs.rate)
        self.sample.extend(obs.arrivals)
        self._age_sample(now)
        if obs.prompt_tokens:
            self.hit_fraction = 0.5 * self.hit_fraction + 0.5 * obs.cached_tokens / obs.prompt_tokens
        cv2 = arrival_cv2(self.sample)
        self.prefill_model.arrival_cv2 = self.decode_model.arrival_cv2 = cv2
        sample = [Arrival(a.prompt_len, a.output_len, int(self.hit_fraction * a.prompt_len)) for a in self.sample]
        # Plan for the forecast, or for the bursts inside the interval if they ran higher: a
        # TTFT SLO of seconds is missed by a queue that builds over seconds, which an interval's
        # mean does not show.
        burst = burst_rate(obs)
        rate = self.forecaster.predict(now + cfg.interval_s + cfg.startup_s)
        if burst > rate + 2 * math.sqrt(rate / BURST_WINDOW_S):  # beyond Poisson noise: real bursts
            rate = burst
        pt, dt = self.prefill_model.terms(sample), self.decode_model.terms(sample)
        self.decode_model.hold_s = self.correction["prefill"] * pt.service_mean
        block = self._block(obs, current)
        if block is not None:
            self._correct(*block, pt, dt)
        need = self._size(rate, pt, dt)
        # A scale-down also needs confidence that the load fell: the planned rate plus two
        # Poisson standard errors, so that a quiet interval at low rates (a handful of arrivals)
        # does not shed a worker the next one needs back. The error is the rate's over a
        # quarter of the scale-down window, not over one interval: the window's highest plan
        # is kept anyway, and the maximum of 20 one-interval margins would count noise twice.
        # The window's maximum, the noise and the hysteresis are the whole margin: a forecast
        # 600 s ahead (the trend's slope x 600 s, mostly noise at a few arrivals per interval)
        # and a goal tightened for shrinking came on top, and kept the pools 1.3-1.9x what the
        # load needed on the Mooncake trace.
        noise = 2 * math.sqrt(rate / max(cfg.interval_s, cfg.scale_down_window_s / 4))
        relaxed = self._size((rate + noise) * (1 + cfg.hysteresis), pt, dt)
        desired, reasons = self._policy(now, current, need, relaxed)
        inputs = {"rate_observed": obs.rate, "rate_burst": burst, "rate_planned": rate, "sample": len(self.sample),
                  "arrival_cv2": cv2, "prefix_hit_fraction": self.hit_fraction,
                  "attainment_observed": obs.attainment(), "correction": dict(self.correction),
                  "attainment_offset": dict(self.offset), "model_trusted": {p: self._trust(p) for p in POOLS},
                  "predicted": self._predict(rate, desired, pt, dt)}
        decision = Decision(now, dict(current), desired, need, reasons, inputs)
        for p in POOLS:
            if desired[p] != current.get(p, 0):
                self.last_change[p] = now
        log.info("planner decision", extra={"decision": decision.to_dict()})
        return decision

    def goal(self, pool: str) -> float:
        """The attainment a pool's model must predict: the per-pool target, less the offset seen
        between observed and predicted attainment (a pessimistic model asks for less)."""
        lo, hi = GOAL_RANGE
        return min(max(self.per_pool_target - self.offset[pool], lo), hi)

    def _trust(self, pool: str) -> bool:
        """Whether the model's diminishing returns may stop a pool's growth. Not when observation
        says the model is optimistic, except when that says nothing about more workers: the
        offset was measured before the last change took effect (growing again on it would
        chase the same evidence twice), or the last growth it drove bought no attainment (the
        misses are ones more workers do not save)."""
        if self.offset[pool] > -DISTRUST:
            return True
        seen = self.seen[pool]
        if not seen or seen[-1][0] < self.last_change[pool] + self.cfg.startup_s:
            return True
        if len(seen) == 2:
            (_, before, got_before), (_, after, got_after) = seen
            if after >= PAID_GROWTH * before and got_after - got_before < PAID_GAIN:
                return True
        return False

    def _size(self, rate: float, pt: Terms, dt: Terms) -> dict[str, int]:
        lim = self.cfg
        trust = {p: self._trust(p) for p in POOLS}
        return {"prefill": self.prefill_model.prefill_workers(rate, pt, self.goal("prefill"),
                                                              self.correction["prefill"],
                                                              limit=lim.prefill.max_replicas, trust=trust["prefill"]),
                "decode": self.decode_model.decode_workers(rate, dt, self.goal("decode"),
                                                           self.correction["decode"], limit=lim.decode.max_replicas,
                                                           trust=trust["decode"])}

    def _predict(self, rate: float, workers: dict[str, int], pt: Terms, dt: Terms) -> dict[str, float]:
        return {"ttft_attainment": self.prefill_model.prefill_attainment(workers["prefill"], rate, pt,
                                                                         self.correction["prefill"]),
                "tpot_attainment": self.decode_model.decode_attainment(workers["decode"], rate, dt,
                                                                       self.correction["decode"])}

    # ---- observed against predicted --------------------------------------------------------
    def _block(self, obs: Observation, current: dict[str, int]) -> tuple[Observation, dict[str, float]] | None:
        """Intervals gathered until they hold min_samples finished requests (at low rates one
        interval holds a handful), merged into one observation with the replicas averaged."""
        self.pending.append((obs, dict(current)))
        if sum(len(o.finished) for o, _ in self.pending) < self.cfg.min_samples:
            if obs.end_s - self.pending[0][0].start_s > self.cfg.scale_down_window_s:
                self.pending.pop(0)  # too old to describe the present
            return None
        block, self.pending = self.pending, []
        span = sum(o.duration_s for o, _ in block)
        merged = Observation(block[0][0].start_s, block[0][0].start_s + span,
                             [a for o, _ in block for a in o.arrivals], [f for o, _ in block for f in o.finished])
        avg = {p: sum(c.get(p, 0) * o.duration_s for o, c in block) / span for p in POOLS}
        return merged, avg

    def _correct(self, obs: Observation, current: dict[str, float], pt: Terms, dt: Terms) -> None:
        """Learn where the profile is off, from steady intervals (the rate within 1.5x of the
        last one) where the pools were lightly loaded: there a request's served time is its
        service time, while under load or after a burst it also holds the wait for other
        prompts in its batch and for the batch's steps, which the queueing model already counts."""
        done = obs.finished
        steady = self.prev_rate > 0 and 2 / 3 <= obs.rate / self.prev_rate <= 1.5
        self.prev_rate = obs.rate
        if not steady:  # a burst's latency is queueing, not the profile
            return
        self._offsets(obs, current, pt, dt)
        prof_p, prof_d = self.prefill_model.profile, self.decode_model.profile
        chunk = self.prefill_model.chunk
        # Load by what arrived and by what finished: a lull's finishers were served in a burst.
        rate = max(obs.rate, len(done) / obs.duration_s)
        busy = rate * pt.kept * self.correction["prefill"] * pt.service_mean / max(current.get("prefill", 1), 1)
        if busy < LIGHT_LOAD:
            served = statistics.fmean(max(f.ttft_s - f.queue_s, 0.0) for f in done)
            predicted = statistics.fmean(prof_p.prefill_seconds(f.prompt_len, 0, chunk) for f in done)
            self._blend("prefill", served / predicted if predicted > 0 else 1.0)
        multi = [f for f in done if f.output_len > 1]
        if not multi or not current.get("decode"):
            return
        tpot = statistics.fmean(f.tpot_s for f in multi)
        outs = statistics.fmean(f.output_len for f in multi)
        ctx = round(statistics.fmean(f.prompt_len + f.output_len / 2 for f in multi))
        batch = len(multi) / obs.duration_s * outs * tpot / current["decode"]  # Little's law
        if rate * dt.mean_output * tpot / current["decode"] < 1.0:  # mostly alone: ITL is the profile's
            xfer = statistics.fmean(prof_d.transfer_seconds(f.prompt_len) / (f.output_len - 1) for f in multi)
            predicted = prof_d.itl_seconds(1.0 + batch, ctx) + xfer  # itself and, on average, the batch
            self._blend("decode", tpot / predicted if predicted > 0 else 1.0)

    def _offsets(self, obs: Observation, current: dict[str, float], pt: Terms, dt: Terms) -> None:
        done = obs.finished
        seen = {"prefill": statistics.fmean(f.ttft_s <= f.ttft_slo_s for f in done),
                "decode": statistics.fmean(f.output_len <= 1 or f.tpot_s <= f.tpot_slo_s for f in done)}
        said = {"prefill": self.prefill_model.prefill_attainment(max(round(current.get("prefill", 0)), 1), obs.rate,
                                                                 pt, self.correction["prefill"]),
                "decode": self.decode_model.decode_attainment(max(current.get("decode", 0), 1.0), obs.rate, dt,
                                                              self.correction["decode"])}
        for pool in POOLS:
            self.seen[pool].append((obs.start_s, current.get(pool, 0), seen[pool]))
            off = 0.7 * self.offset[pool] + 0.3 * (seen[pool] - said[pool])
            self.offset[pool] = min(max(off, -OFFSET_LIMIT), OFFSET_LIMIT)

    def _blend(self, pool: str, ratio: float) -> None:
        lo, hi = CORRECTION_RANGE
        self.correction[pool] = min(max(0.5 * self.correction[pool] + 0.5 * ratio, lo), hi)

    # ---- the policy -----------------------------------------------------------------------
    def _policy(self, now: float, current: dict[str, int], need: dict[str, int], relaxed: dict[str, int],
                ) -> tuple[dict[str, int], dict[str, str]]:
        cfg = self.cfg
        desired, reasons = {}, {}
        for p in POOLS:
            lim = getattr(cfg, p)
            cur = current.get(p, 0)
            want = min(max(need[p], lim.min_replicas), lim.max_replicas)
            hist = self.history[p]
            hist.append((now, min(max(relaxed[p], lim.min_replicas), lim.max_replicas)))
            while hist and hist[0][0] < now - cfg.scale_down_window_s:
                hist.popleft()
            if want > cur or cur < lim.min_replicas:
                # At once, but at most doubling per interval: a model that asks for far more
                # than there is gets to see the result before it asks again.
                grown = min(max(want, lim.min_replicas), max(2 * cur, cur + 1, lim.min_replicas))
                desired[p], reasons[p] = grown, f"scale up: the load needs {need[p]}"
                continue
            floor = max(r for _, r in hist)
            if floor >= cur:
                desired[p], reasons[p] = cur, "hold"
            elif now - self.last_change[p] < cfg.cooldown_s:
                desired[p], reasons[p] = cur, f"hold: cooldown after the last change ({cfg.cooldown_s:.0f} s)"
            else:
                step = max(1, math.floor(cur * cfg.max_scale_down_fraction))
                desired[p] = max(floor, cur - step)
                reasons[p] = (f"scale down: {cfg.scale_down_window_s:.0f} s of plans at +{cfg.hysteresis:.0%} "
                              f"load need at most {floor}")
        return self._budget(desired, need, reasons), reasons

    def _budget(self, desired: dict[str, int], need: dict[str, int], reasons: dict[str, str]) -> dict[str, int]:
        total = self.cfg.max_total_workers
        if total is None or sum(desired.values()) <= total:
            return desired
        # Over the budget: share it in proportion to need, each pool keeping its minimum.
        mins = {p: getattr(self.cfg, p).min_replicas for p in POOLS}
        weight = sum(max(need[p], 1) for p in POOLS)
        out = {p: max(mins[p], math.floor(total * max(need[p], 1) / weight)) for p in POOLS}
        while sum(out.values()) > total:
            p = max(POOLS, key=lambda q: out[q] - mins[q])
            out[p] -= 1
        while sum(out.values()) < min(total, sum(desired.values())):  # rounding left some: to the neediest
            p = max(POOLS, key=lambda q: need[q] - out[q])
            out[p] += 1
        for p in POOLS:
            reasons[p] += f"; capped by max_total_workers {total}"
        return out
