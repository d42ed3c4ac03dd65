"""Where Ray puts pdserve's actors, and what address each advertises from there."""

from __future__ import annotations

from typing import Any

from pdcommon.config import ClusterConfig

WILDCARDS = ("0.0.0.0", "::", "")


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options from a pool's `resources` (CPU and GPU are Ray's own; the rest custom)."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    opts: dict[str, Any] = {"num_cpus": resources.get("CPU", 0)}
    if resources.get("GPU"):
        opts["num_gpus"] = resources["GPU"]
    if custom:
        opts["resources"] = custom
    return opts


def advertise_node_ip(cfg: ClusterConfig, role: str) -> None:
    """A component (`router` or a pool) bound to every interface with no advertised host
    advertises the IP of the Ray node it runs on: on a multi-host cluster a fixed config cannot
    name it in advance. Only its own section: the others run elsewhere."""
    section = cfg.router if role == "router" else cfg.pool(role)
    if section.advertise_host is None and section.host in WILDCARDS:
        section.advertise_host = node_ip()


def node_ip() -> str:
    """The address of the Ray node this process runs on, as the cluster knows it. (Inside an actor,
    ray.util.get_node_ip_address() guesses from the default route, which names another node's
    address, or none, on hosts whose default route leads elsewhere.)"""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == here:
            return node["NodeManagerAddress"]
    raise RuntimeError(f"this Ray node ({here}) is not in the cluster's node table")


def on_this_node() -> dict[str, Any]:
    """Scheduling that keeps an actor on the driver's node (hard affinity)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                   soft=False)}
