"""Pool planners (issue 11): `static` keeps the configured replicas; `sla` sizes the prefill and
decode pools from TTFT and TPOT targets. The router and the simulator run the same planners."""

from router.planner.base import Arrival, Decision, Finished, Observation, Planner
from router.planner.registry import PLANNERS, make_planner
from router.planner.sizing import PoolModel, Slos, erlang_c
from router.planner.sla import SlaPlanner
from router.planner.static import StaticPlanner

__all__ = ["PLANNERS", "Arrival", "Decision", "Finished", "Observation", "Planner", "PoolModel", "SlaPlanner",
           "Slos", "StaticPlanner", "erlang_c", "make_planner"]
