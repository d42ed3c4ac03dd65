"""Prefill attainment by replaying the arrivals the router saw through c workers.

A queueing formula needs the arrival process as one number (M/G/c with Allen-Cunneen's
(ca^2 + cs^2) / 2), and real traces are not that: the Azure code trace sends requests in
clusters of seconds, whose squared coefficient of variation (16, clamped) made the formula
ask for 2.5x the workers a fixed split needed. Its wait also grows with the variance of a
gap whatever its scale, while a TTFT SLO is missed only by queues that outlast a request's
slack. Replaying the recent arrivals, with their real times and lengths, through c servers
measures exactly that, at the cost of a heap operation per request.

The router sends a prompt to the prefill worker with the least queued work, so a worker's
queue drains in order and a prompt starts when the first worker frees up: a central FCFS
queue in front of c servers, which is what the replay runs. A different rate than the sample's
own is planned for by compressing (or stretching) its time axis: bursts keep their shape and
grow with the load.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

MIN_ARRIVALS = 32  # fewer timed arrivals: too few to show the process; the formula decides


def with_backlog(arrivals: list[tuple[float, float, float]], backlog: int, service_s: float,
                 ) -> list[tuple[float, float, float | None]]:
    """The arrivals with `backlog` queued requests (no first token yet when the plan is made)
    spread evenly over their span, each of `service_s`, and no SLO of their own: the pool must
    clear a step's backlog within about one window beside the new load, not at once (they have
    waited already; clearing them at once would take a worker per two of them)."""
    if not arrivals or backlog <= 0:
        return list(arrivals)
    t0, t1 = arrivals[0][0], arrivals[-1][0]
    extra = [(t0 + (t1 - t0) * (i + 0.5) / backlog, service_s, None) for i in range(backlog)]
    return list(heapq.merge(arrivals, extra, key=lambda a: a[0]))


def replay_met(arrivals: Sequence[tuple[float, float, float | None]], workers: int, speedup: float = 1.0,
               correction: float = 1.0) -> float:
    """The share of `arrivals` ((time, service, TTFT SLO), in time order; no SLO: work that
    counts for nothing) whose wait plus corrected service meets the SLO, with `workers` servers
    and the arrivals `speedup` times as dense."""
    if not arrivals:
        return 1.0
    workers = max(workers, 1)
    free = [arrivals[0][0] / speedup] * workers  # each worker's next free time (a heap)
    replace = heapq.heapreplace
    met = counted = 0
    # The planner replays its whole window (tens of thousands of arrivals at 512 workers) for
    # each pool size it tries: the loop is kept to plain comparisons and one heap operation.
    for t, s, limit in arrivals:
        at = t / speedup
        start = free[0]
        if start < at:
            start = at
        took = correction * s
        replace(free, start + took)
        if limit is not None:
            counted += 1
            if start - at + took <= limit:
                met += 1
    return met / counted if counted else 1.0
