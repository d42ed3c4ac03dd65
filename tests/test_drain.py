"""SIGTERM drains a worker: it stops taking work, finishes the streams it holds, leaves the
router, and exits — what a Kubernetes pod going away (or `kill`) relies on."""

from __future__ import annotations

import signal
import threading
import time

from pdcommon.client import make_request
from tests.cluster_utils import ProcessCluster

STREAMS, TOKENS = 6, 120


def test_sigterm_drains_in_flight_streams_then_leaves(stories_path, tmp_path):
    # Device emulation (EngineConfig.emulate_device_s_per_token) stretches the streams to seconds,
    # so that the signal lands while all of them are in flight.
    cluster = ProcessCluster(stories_path, tmp_path, prefill=1, decode=1,
                             **{"engine.emulate_device_s_per_token": 0.003, "process.drain_timeout_s": 30,
                                "process.ready_file": str(tmp_path / "state" / "{worker_id}.ready")})
    try:
        ready = tmp_path / "state" / "decode-0.ready"  # its folder made as needed
        # A worker writes its file after its first heartbeat's reply, one round trip after the
        # router counts it registered (what the cluster's start waits for): a CI run looked sooner.
        end = time.monotonic() + 10
        while not (ready.exists() and (tmp_path / "state" / "prefill-0.ready").exists()) and time.monotonic() < end:
            time.sleep(0.05)
        assert ready.exists() and (tmp_path / "state" / "prefill-0.ready").exists(), "registered, active: ready"
        results: list[tuple[int, str] | BaseException] = []
        first = threading.Barrier(STREAMS + 1, timeout=60)

        def stream(i: int) -> None:
            try:
                with cluster.client() as c:
                    n, reason, seen = 0, "", False
                    for msg in c.stream(make_request(f"Once upon a time {i}", max_tokens=TOKENS, ignore_eos=True),
                                        timeout=120):
                        n += len(msg.token_ids)
                        reason = msg.finish_reason or reason
                        if not seen:
                            seen = True
                            first.wait()
                    results.append((n, reason))
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                results.append(e)
                first.abort()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        first.wait()  # every stream has its first token: all are on the decode worker now
        t0 = time.monotonic()
        cluster.signal("decode-0", signal.SIGTERM)
        # The router hears of the drain within a heartbeat and stops sending work there.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            with cluster.client() as c:
                states = {w.worker_id: w.state for w in c.status().workers}
            if states.get("decode-0") == "draining":
                break
            time.sleep(0.05)
        assert states.get("decode-0") == "draining", states
        end = time.monotonic() + 5
        while ready.exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert not ready.exists(), "a draining worker is not ready (no new work through a Service either)"
        for t in threads:
            t.join(120)
        assert results == [(TOKENS, "length")] * STREAMS, results
        code = cluster.procs["decode-0"].wait(30)
        took = time.monotonic() - t0
        assert code == 0, (tmp_path / "decode-0.log").read_text()[-2000:]
        with cluster.client() as c:
            assert "decode-0" not in {w.worker_id for w in c.status().workers}, "it left the router"
        log = (tmp_path / "decode-0.log").read_text()
        assert "drained (0 requests unfinished)" in log, log[-2000:]
        assert took < 30, took
    finally:
        cluster.stop()
