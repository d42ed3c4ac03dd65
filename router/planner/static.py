"""The static planner: the replicas the config (or a search) fixed, whatever the load."""

from __future__ import annotations

import math

from router.planner.base import Decision, Observation


class StaticPlanner:
    name = "static"

    def request_slos(self, prompt_len: int, output_len: int) -> tuple[float, float]:
        return math.inf, math.inf  # it plans for none

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)

    def plan(self, obs: Observation, current: dict[str, int]) -> Decision:
        reasons = {p: "static" for p in self.replicas}
        return Decision(obs.end_s, dict(current), dict(self.replicas), dict(self.replicas), reasons,
                        {"rate_observed": obs.rate, "attainment_observed": obs.attainment()})
