"""Test helpers: cluster configs on several loopback addresses, and pool checks."""

from __future__ import annotations

import time
from pathlib import Path

from pdcommon.client import RouterClient
from pdcommon.config import ClusterConfig, load_config
from pdserve.launch.inprocess import InProcessCluster

__all__ = ["InProcessCluster", "cluster_config", "make_config", "wait_pools_empty"]


def make_config(model: str, **overrides) -> ClusterConfig:
    base = {"model": model, "router.port": 0, "router.http_port": 0, "router.host": "127.0.0.1",
            "prefill.host": "127.0.0.1", "decode.host": "127.0.0.1", "colocated.host": "127.0.0.1",
            "heartbeat.interval_s": 0.3, "engine.num_threads": 1}
    base.update(overrides)
    return load_config(None, **base)


HEARTBEAT = 0.5


def cluster_config(model: str, transport: str, prefill: int, decode: int, **extra):
    return load_config(Path(__file__).resolve().parent.parent / "configs" / "local.yaml", **{
        "model": model, "router.port": 0, "router.http_port": 0, "transfer.transport": transport,
        "heartbeat.interval_s": HEARTBEAT,
        "prefill.replicas": prefill, "decode.replicas": decode, "engine.kv_cache_memory_bytes": 32 << 20, **extra})


def wait_pools_empty(client: RouterClient, timeout: float = 20.0) -> None:
    """Every worker's pool back to zero referenced blocks (as its heartbeats report)."""
    time.sleep(2.5 * HEARTBEAT)
    end = time.monotonic() + timeout
    while True:
        st = client.status()
        used = {w.worker_id: w.used_blocks for w in st.workers if w.used_blocks or w.num_running}
        if not used:
            return
        assert time.monotonic() < end, f"blocks still referenced: {used}"
        time.sleep(HEARTBEAT)
