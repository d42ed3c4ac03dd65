"""Load forecasts: the request rate one horizon ahead, from the rates of past intervals."""

from __future__ import annotations

from typing import Protocol


class Forecaster(Protocol):
    def observe(self, t: float, rate: float) -> None: ...

    def predict(self, t: float) -> float: ...


class Constant:
    """The next interval looks like the last one."""

    def __init__(self) -> None:
        self.last = 0.0

    def observe(self, t: float, rate: float) -> None:
        self.last = rate

    def predict(self, t: float) -> float:
        return self.last


class Trend:
    """Holt's linear smoothing: a level and a slope, both exponentially smoothed, extrapolated to
    the forecast time, within `reach` of the level either way (a trend seen over a few
    intervals does not double or zero the load minutes ahead)."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3, reach: float = 0.5) -> None:
        self.alpha, self.beta, self.reach = alpha, beta, reach
        self.level: float | None = None
        self.slope = 0.0  # per second
        self.t = 0.0

    def observe(self, t: float, rate: float) -> None:
        if self.level is None:
            self.level, self.t = rate, t
            return
        dt = max(t - self.t, 1e-9)
        prev = self.level
        self.level = self.alpha * rate + (1 - self.alpha) * (prev + self.slope * dt)
        self.slope = self.beta * (self.level - prev) / dt + (1 - self.beta) * self.slope
        self.t = t

    def predict(self, t: float) -> float:
        if self.level is None:
            return 0.0
        trend = self.slope * max(t - self.t, 0.0)
        return max(self.level + min(max(trend, -self.reach * self.level), self.reach * self.level), 0.0)


FORECASTERS: dict[str, type] = {"constant": Constant, "trend": Trend}
