"""Pools grow and shrink while requests stream; leaving workers drain, nothing is lost."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.client import RouterClient, make_request
from pdserve.launch.cluster import RayCluster
from tests.cluster_utils import cluster_config, wait_pools_empty


def test_scale_decode_pool_while_streaming(stories_path, story, tmp_path):
    """Under mutual TLS (token mode's Scale is covered by tests/test_cli.py): new workers join with
    the cluster's certificates and the operator's Scale call needs them too."""
    from pdserve.certs import make_certs

    ref_engine = LLMEngine(EngineConfig(model=stories_path))
    prompts = [story[: 5 + 3 * i] for i in range(16)]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    refs = [r["token_ids"] for r in ref_engine.generate(prompts, params)]
    cfg = cluster_config(stories_path, "zmq", 1, 1, **{"security.mode": "mtls",
                                                      "security.certs_dir": str(make_certs(tmp_path / "certs"))})
    results: dict[int, object] = {}

    with RayCluster(cfg) as cluster, RouterClient(cluster.address) as client, cluster.control_client() as control:
        def run(i: int) -> None:
            try:
                results[i] = client.generate(make_request(prompts[i], max_tokens=300, ignore_eos=True), timeout=300)
            except grpc.RpcError as e:
                results[i] = e

        pool = ThreadPoolExecutor(16)
        futs = [pool.submit(run, i) for i in range(4)]
        control.scale("decode", 3)
        end = time.monotonic() + 120
        while client.health().decode_workers < 3:
            assert time.monotonic() < end, "new decode workers never registered"
            time.sleep(0.2)
        futs += [pool.submit(run, i) for i in range(4, 12)]
        end = time.monotonic() + 30
        while True:  # until every decode worker streams some of the requests
            st = client.status()
            inflight = {w.worker_id: w.inflight for w in st.workers if w.role == "decode"}
            if len(inflight) == 3 and all(inflight.values()):
                break
            assert time.monotonic() < end, f"the load never spread over the three decode workers: {inflight}"
            time.sleep(0.05)
        r = control.scale("decode", 1)
        drained = set(r.draining)
        assert len(drained) == 2
        # The scaler drains the least loaded, which still have requests in flight: they must finish.
        assert all(inflight[w] > 0 for w in drained), inflight
        futs += [pool.submit(run, i) for i in range(12, 16)]
        for f in futs:
            f.result(300)
        pool.shutdown()
        for i in range(16):
            out = results[i]
            assert not isinstance(out, grpc.RpcError), f"request {i} failed: {out}"
            assert out.token_ids == refs[i], f"request {i} got other tokens"
        served_by = {out.decode_worker for out in results.values()}
        assert served_by - {"decode-0"}, "some requests were served by the added workers"
        assert served_by & drained, "requests in flight on the drained workers finished there"
        end = time.monotonic() + 60
        while client.health().decode_workers != 1 or len(client.status().workers) != 2:
            assert time.monotonic() < end, "drained workers were not removed"
            time.sleep(0.3)
        wait_pools_empty(client)


def test_a_retired_worker_cannot_rejoin():
    """A scale-down drops a drained worker at once, but its process lives until the launcher ends
    it (a pod's SIGTERM may come seconds later). Its heartbeats must tell it to drain and its
    registration be refused, or it joins again as a fresh worker and takes new requests."""
    import asyncio
    from types import SimpleNamespace

    from pdcommon.v1 import worker_pb2 as wpb
    from router.core import RouterCore
    from router.membership import Membership
    from router.service import ControlService

    members = Membership(dead_after_s=5)
    core = SimpleNamespace(members=members, cfg=SimpleNamespace(roles=("prefill", "decode"), mode="disaggregated"),
                           model=SimpleNamespace(fingerprint="fp", name="m"))
    info = wpb.WorkerInfo(worker_id="decode-0", role="decode", address="127.0.0.1:9", incarnation="one",
                          model_fingerprint="fp")

    async def main() -> tuple:
        control = ControlService(core, scaler=None)
        members.register(info)
        members.retire("decode-0")
        gone = await control.Heartbeat(wpb.HeartbeatRequest(worker_id="decode-0", incarnation="one"), None)
        other = await control.Heartbeat(wpb.HeartbeatRequest(worker_id="decode-0", incarnation="two"), None)
        return gone, other

    gone, other = asyncio.run(main())
    assert (gone.known, gone.drain) == (False, True)  # go away; do not register again
    assert (other.known, other.drain) == (False, False)  # a new process under that id may join
    assert "scale-down" in RouterCore.check_worker(core, info)
    assert "decode-0" not in members.workers
