"""Planners by name, built from the cluster config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pdcommon.config import ClusterConfig
from pdcommon.step_cost import StepCostModel
from router.planner.base import Planner
from router.planner.sla import SlaPlanner
from router.planner.static import StaticPlanner


def _static(cfg: ClusterConfig) -> Planner:
    return StaticPlanner({role: cfg.pool(role).replicas or 0 for role in cfg.roles})


def _sla(cfg: ClusterConfig) -> Planner:
    if cfg.mode != "disaggregated":
        raise ValueError("planner.mode sla sizes a prefill and a decode pool; this cluster is colocated")
    profile = StepCostModel.load(Path(cfg.planner.profile).expanduser())
    return SlaPlanner(cfg.planner, profile, chunk=cfg.engine_config("prefill").max_num_batched_tokens)


PLANNERS: dict[str, Callable[[ClusterConfig], Planner]] = {"static": _static, "sla": _sla}


def make_planner(cfg: ClusterConfig) -> Planner:
    return PLANNERS[cfg.planner.mode](cfg)
