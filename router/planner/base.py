"""What a planner sees and what it decides.

The router (live) and the simulator (`pdserve simulate`) feed a planner the same thing each
interval: the requests that arrived, and the ones that finished with their queue time, TTFT and
TPOT. The planner answers with the replicas each pool should have, and why. Carrying the
decision out (Ray, Kubernetes, the simulator's workers) is the caller's business.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Arrival:
    prompt_len: int
    output_len: int  # max_tokens: what the decode pool reserves KV for
    cached_len: int = 0  # prompt tokens a prefix cache holds (the planner fills it in from the hit rate)
    at_s: float | None = None  # when it arrived (the burstiness of arrivals matters to queueing)


@dataclass(frozen=True, slots=True)
class Finished:
    prompt_len: int
    output_len: int
    queue_s: float  # arrival -> prefill start (router queue and the prefill worker's own)
    ttft_s: float  # arrival -> first token: queueing included
    tpot_s: float  # (last token - first token) / (tokens - 1); 0 for one-token requests
    ttft_slo_s: float
    tpot_slo_s: float
    batch: float | None = None  # the mean batch of its decode steps, where its worker counted them

    @property
    def met_ttft(self) -> bool:
        return self.ttft_s <= self.ttft_slo_s

    @property
    def met_tpot(self) -> bool:
        return self.output_len <= 1 or self.tpot_s <= self.tpot_slo_s

    @property
    def met(self) -> bool:
        return self.met_ttft and self.met_tpot


@dataclass(slots=True)
class Observation:
    """One planning interval, [start_s, end_s)."""

    start_s: float
    end_s: float
    arrivals: list[Arrival] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    # Prefix-cache hits of the prompts that started prefill in the interval, in tokens.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Requests that had arrived and had no first token yet when the interval ended: the backlog
    # a step in load leaves, which a replay starting from an empty queue would not see.
    waiting: int = 0
    # Requests that ended in the interval with no answer after the router took them (refused as
    # too big for any worker's KV, failed): misses that `finished` does not hold.
    failed: int = 0

    @property
    def duration_s(self) -> float:
        return max(self.end_s - self.start_s, 1e-9)

    @property
    def rate(self) -> float:
        return len(self.arrivals) / self.duration_s

    def attainment(self) -> float | None:
        """The share of the requests that ended in the interval that met both SLOs (failed ones
        missed)."""
        ended = len(self.finished) + self.failed
        return sum(f.met for f in self.finished) / ended if ended else None


@dataclass(slots=True)
class Decision:
    at_s: float
    current: dict[str, int]
    desired: dict[str, int]  # after limits, budget, cooldowns and hysteresis: what to run
    recommended: dict[str, int]  # what the load alone asks for
    reasons: dict[str, str]
    inputs: dict = field(default_factory=dict)  # forecast, corrections, predictions

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def to_dict(self) -> dict:
        return asdict(self)


class Planner(Protocol):
    """One call per interval. `current` counts the workers of each pool that serve or are
    starting (draining ones are gone already)."""

    name: str

    def plan(self, obs: Observation, current: dict[str, int]) -> Decision: ...

    def request_slos(self, prompt_len: int, output_len: int) -> tuple[float, float]:
        """The TTFT and TPOT SLO (seconds) a request of these lengths is held to."""
        ...
