"""Self-healing under `pdserve up` (RayCluster): a dead worker is replaced within 60 s; a dead
router is restarted by Ray on the same address, and the workers outlive it and re-register."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from pdcommon.client import RouterClient, make_request
from pdserve.launch.cluster import RayCluster
from tests.cluster_utils import cluster_config


@pytest.fixture(scope="module")
def cluster(stories_path):
    cfg = cluster_config(stories_path, "zmq", 1, 1, **{"heartbeat.timeout_s": 2.0, "router.replace_after_s": 1.0})
    with RayCluster(cfg) as c:
        yield c


def _wait(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if pred():
                return time.monotonic() - t0
        except grpc.RpcError:
            pass  # the router is restarting
        assert time.monotonic() - t0 < timeout, f"{what} did not happen within {timeout:.0f}s"
        time.sleep(0.2)


def test_dead_worker_is_replaced_within_60s(cluster):
    pids = cluster.worker_pids()
    os.kill(pids["decode-0"], signal.SIGKILL)
    with RouterClient(cluster.address) as c:
        def replaced() -> bool:
            ids = {w.worker_id for w in c.status().workers if w.role == "decode" and w.state == "active"}
            return "decode-0" not in ids and len(ids) == 1
        took = _wait(replaced, 60, "a replacement decode worker registering")
        out = c.generate(make_request("Once upon a time", max_tokens=8), timeout=60)
    assert out.finish_reason == "length" and out.decode_worker != "decode-0"
    print(f"replacement registered {took:.1f}s after the kill")


def test_router_restart_keeps_the_workers(cluster):
    before = cluster.worker_pids()
    router_pid = cluster.router_pid()
    with RouterClient(cluster.address) as c:
        stream = c.stream(make_request("Once upon a time", max_tokens=400, ignore_eos=True), timeout=60)
        next(stream)
        os.kill(router_pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as ei:
            for _ in stream:
                pass
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE  # only the request in flight sees it
    with RouterClient(cluster.address) as c:  # the same address: Ray restarted the router there
        _wait(lambda: c.health().ready, 90, "the restarted router becoming ready")
        out = c.generate(make_request("Once upon a time", max_tokens=8), timeout=60)
        assert out.finish_reason == "length"
        served_by = {out.prefill_worker, out.decode_worker}
    assert cluster.router_pid() != router_pid
    after = cluster.worker_pids()
    assert after == before, "the workers outlived the router and kept their processes"
    assert served_by <= set(before)
