"""configs/ray/: the `ray up` cluster YAMLs pass Ray's own config validation, declare a node type
(a custom resource) per pool, and configs/ray/pdserve.yaml's pools ask for exactly those.
The local-provider YAML also runs for real in tests/test_ray_up.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pdcommon.config import load_config

RAY = Path(__file__).resolve().parent.parent / "configs" / "ray"


def checked(name: str) -> dict:
    cfg = yaml.safe_load((RAY / name).read_text())
    validate_config(prepare_config(copy.deepcopy(cfg)))  # what `ray up` runs before anything else
    return cfg


def test_cloud_yaml_has_a_node_type_per_pool():
    cfg = checked("aws.yaml")
    types = cfg["available_node_types"]
    assert types["prefill"]["resources"] == {"pdserve_prefill": 1}
    assert types["decode"]["resources"] == {"pdserve_decode": 1}
    assert types[cfg["head_node_type"]]["resources"] == {"CPU": 0}  # the router's node takes no worker
    assert "-c constraints.txt" in " ".join(cfg["setup_commands"])


def test_local_yaml_gives_the_head_prefill_and_the_hosts_decode():
    cfg = checked("local.yaml")
    head, worker = " ".join(cfg["head_start_ray_commands"]), " ".join(cfg["worker_start_ray_commands"])
    assert '"pdserve_prefill"' in head and "--node-ip-address" in head
    assert "pdserve_$pool" in worker and "pool=decode" in worker and "--node-ip-address" in worker


def test_a_broken_cluster_yaml_is_rejected():
    cfg = yaml.safe_load((RAY / "aws.yaml").read_text())
    cfg["available_node_types"]["decode"]["min_workrs"] = 1
    with pytest.raises(Exception, match="min_workrs"):
        validate_config(prepare_config(cfg))


def test_pdserve_config_places_each_pool_on_its_node_type():
    cfg = load_config(RAY / "pdserve.yaml")
    assert cfg.ray.address == "auto"
    assert cfg.prefill.resources == {"pdserve_prefill": 1} and cfg.decode.resources == {"pdserve_decode": 1}
    # Bound to every interface, advertising the node each lands on (pdserve/launch/placement.py).
    assert {cfg.router.host, cfg.prefill.host, cfg.decode.host} == {"0.0.0.0"}
    assert cfg.prefill.advertise_host is None and cfg.decode.advertise_host is None


def test_pool_resources_become_actor_options():
    from pdserve.launch.placement import actor_options

    assert actor_options({}) == {"num_cpus": 0}
    assert actor_options({"CPU": 2, "GPU": 1, "pdserve_prefill": 1}) == {
        "num_cpus": 2, "num_gpus": 1, "resources": {"pdserve_prefill": 1}}
