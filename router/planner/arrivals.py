"""Statistics of an arrival sample: its rate, the rate its requests meet inside bursts, and the
variation of its gaps. The planner's sizing reads them; none needs more than the arrival times."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

BURST_WINDOW_S = 5.0
CV2_RANGE = (0.5, 16.0)


def sample_rate(times: Sequence[float], count: int) -> float:
    """Arrivals per second of a sample spanning `times` (`count` arrivals, refused ones too)."""
    span = times[-1] - times[0] if times else 0.0
    return (count - 1) / span if span > 0 and count > 1 else 0.0


def burst_rate(times: list[float], start: float, end: float) -> float:
    """The arrival rate a typical request of [start, end) meets: over BURST_WINDOW_S windows,
    weighted by arrivals (sum c^2 / sum c / W), less the request itself. Poisson arrivals give
    about the mean; on/off bursts give the rate while on. A decode batch lives about as long as
    a window, so this, and not the mean, is the rate its Little's law sees."""
    n = int((end - start) // BURST_WINDOW_S)
    inside = [t for t in times if start <= t < end]
    if n < 2 or not inside:
        return len(inside) / max(end - start, 1e-9)
    counts = [0] * n
    for t in inside:
        counts[min(n - 1, int((t - start) // BURST_WINDOW_S))] += 1
    seen = sum(c * c for c in counts) / len(inside) / BURST_WINDOW_S
    return max(seen - 1 / BURST_WINDOW_S, len(inside) / (end - start))


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
