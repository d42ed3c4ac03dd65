"""The SLA planner's policy: how a plan becomes replicas. Scale up at once (at most doubling a
pool per interval) for a plan more than `scale_up_tolerance` above the pool; scale down only to
the highest plan of the last `scale_down_window_s` at `hysteresis` more load, at most
`max_scale_down_fraction` of a pool per interval, not within `cooldown_s` of a change, not
before a whole window of plans, not while the load is rising; and within `max_total_workers`."""

from __future__ import annotations

import math
from collections import deque

from pdcommon.config import PlannerSection

POOLS = ("prefill", "decode")


class ScalePolicy:
    def __init__(self, cfg: PlannerSection) -> None:
        self.cfg = cfg
        self.history: dict[str, deque[tuple[float, int]]] = {p: deque() for p in POOLS}  # scale-down recs
        self.last_change: dict[str, float] = {p: -math.inf for p in POOLS}  # when each pool last changed
        self.first_plan: float | None = None  # when the planner first planned

    def decide(self, now: float, current: dict[str, int], need: dict[str, int], relaxed: dict[str, int],
               keep_up: dict[str, int] | None = None, missing: dict[str, bool] | None = None,
               rising: bool = False) -> tuple[dict[str, int], dict[str, str]]:
        """What to run per pool, and why, given what the load needs (`need`), what it would need
        at the hysteresis' higher load (`relaxed`, the scale-down window's record), the fewest
        workers that keep up with it at all (`keep_up`: below that a queue grows without end, so
        the scale-up tolerance does not hold a pool there), whether each pool missed its goal
        in the interval just seen (`missing`), and whether the arrivals are rising (`rising`:
        no pool shrinks into a load that is growing)."""
        cfg = self.cfg
        desired, reasons = {}, {}
        if self.first_plan is None:
            self.first_plan = now
        # A scale-down needs a whole window of plans, from the start too: a planner that has
        # seen one interval knows its arrivals, not its bursts. On the Azure code trace the
        # first plan (30 s of a quiet start) shrank the deployed pools by a quarter, and the
        # next five minutes, spent growing them back through the first burst, met 30%.
        young = now - self.first_plan < cfg.scale_down_window_s
        for p in POOLS:
            lim = getattr(cfg, p)
            cur = current.get(p, 0)
            want = min(max(need[p], lim.min_replicas), lim.max_replicas)
            hist = self.history[p]
            hist.append((now, min(max(relaxed[p], lim.min_replicas), lim.max_replicas)))
            while hist and hist[0][0] < now - cfg.scale_down_window_s:
                hist.popleft()
            behind = cur < min((keep_up or {}).get(p, 0), want)
            up = want > cur * (1 + cfg.scale_up_tolerance)
            if up and young and missing is not None and not missing[p] and not behind and cur >= lim.min_replicas:
                # The deployed split was sized from a whole day's load; a plan from the first
                # minutes' arrivals is noisier than that, in both directions. On the Mooncake
                # trace at 512 workers the first 30 s asked for 296 decode workers over the 254
                # deployed while 95% met both SLOs; held for 20 minutes, the pool went down to
                # 228 and had to grow again within 10 minutes.
                desired[p] = cur
                reasons[p] = (f"hold: the load needs {need[p]}, but the pool meets its goal and there are fewer "
                              f"than {cfg.scale_down_window_s:.0f} s of plans")
                continue
            if up or behind or cur < lim.min_replicas:
                # At once, but at most doubling per interval: a model that asks for far more
                # than there is gets to see the result before it asks again.
                grown = min(max(want, lim.min_replicas), max(2 * cur, cur + 1, lim.min_replicas))
                desired[p], reasons[p] = grown, f"scale up: the load needs {need[p]}"
                continue
            if want > cur:
                desired[p] = cur
                reasons[p] = f"hold: the load needs {need[p]}, within {cfg.scale_up_tolerance:.0%} of the pool"
                continue
            desired[p], reasons[p] = self._down(p, now, cur, young, rising)
        desired = self._budget(desired, need, reasons)
        for p in POOLS:
            if desired[p] != current.get(p, 0):
                self.last_change[p] = now
        return desired, reasons

    def _down(self, p: str, now: float, cur: int, young: bool, rising: bool) -> tuple[int, str]:
        """A pool the load needs no more of: down to the window's highest plan, when it may."""
        cfg = self.cfg
        floor = max(r for _, r in self.history[p])
        if floor >= cur:
            return cur, "hold"
        if young:
            return cur, f"hold: fewer than {cfg.scale_down_window_s:.0f} s of plans"
        if rising:
            # The window's plans lag the load by up to a window: past a trough they still say
            # "smaller" while the load climbs back, and the pool must grow again minutes later
            # (a `diurnal:` load of 30-minute period reversed three scale-downs so).
            return cur, "hold: the arrivals are rising"
        if now - self.last_change[p] < cfg.cooldown_s:
            return cur, f"hold: cooldown after the last change ({cfg.cooldown_s:.0f} s)"
        step = max(1, math.floor(cur * cfg.max_scale_down_fraction))
        return max(floor, cur - step), (f"scale down: {cfg.scale_down_window_s:.0f} s of plans at "
                                        f"+{cfg.hysteresis:.0%} load need at most {floor}")

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
