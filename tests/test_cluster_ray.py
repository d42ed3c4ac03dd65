"""End to end on real local clusters: router and pools as Ray actors, KV over each transport."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdcommon.client import RouterClient, make_request
from pdserve.launch.cluster import RayCluster
from tests.cluster_utils import cluster_config, wait_pools_empty
from tests.conftest import hf_greedy


@pytest.fixture(scope="module", params=["zmq", "grpc", "grpc-mtls"])
def cluster(request, stories_path, tmp_path_factory):
    """Each transport in token mode (the default), and gRPC under mutual TLS: control calls and KV
    both over TLS with the cluster's certificates."""
    transport, _, mtls = request.param.partition("-")
    extra = {}
    if mtls:
        from pdserve.certs import make_certs

        extra = {"security.mode": "mtls", "security.certs_dir": str(make_certs(tmp_path_factory.mktemp("certs")))}
    with RayCluster(cluster_config(stories_path, transport, 2, 2, **extra)) as c:
        c.transport = transport
        yield c


def test_32_concurrent_requests_match_transformers(cluster, stories_path, story):
    system = story[:40]
    prompts = []
    for i in range(32):
        if i % 2:
            prompts.append(system + story[60 + 5 * i: 60 + 5 * i + 3 + i])  # shared system prompt
        else:
            prompts.append(story[: 1 + (i * 37) % 300])  # prefixes of one story: lengths 1..300
    max_tokens = [8 + (i * 7) % 40 for i in range(32)]
    refs = [hf_greedy(stories_path, p, m)["token_ids"] for p, m in zip(prompts, max_tokens, strict=True)]
    with RouterClient(cluster.address) as client, ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda a: client.generate(make_request(a[0], max_tokens=a[1]), timeout=120),
                             zip(prompts, max_tokens, strict=True)))
        for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            assert out.token_ids == ref, f"request {i} (prompt {len(prompts[i])} tokens) differs"
            assert out.usage["completion_tokens"] == len(ref)
        workers = {o.prefill_worker for o in outs} | {o.decode_worker for o in outs}
        assert len(workers) == 4, f"all four workers should serve under load, got {workers}"
        wait_pools_empty(client)


def test_shared_prefix_hits_cache_and_ships_fewer_bytes(cluster, story):
    system = story[:150]
    block_bytes = 5 * 2 * 16 * 4 * 8 * 4  # layers x (K,V) x block x kv_heads x head_dim x fp32
    with RouterClient(cluster.address) as client:
        warm = client.generate(make_request(system + story[200:205], max_tokens=5), timeout=60)
        assert warm.usage["kv_transfer_bytes"] > 0
        followers = [client.generate(make_request(system + story[210 + 9 * i: 216 + 9 * i], max_tokens=5), timeout=60)
                     for i in range(4)]
        same = [f for f in followers if (f.prefill_worker, f.decode_worker) == (warm.prefill_worker,
                                                                                warm.decode_worker)]
        assert same, "prefix-aware routing should send followers to the warm workers"
        for f in same:
            full = -(-f.usage["prompt_tokens"] // 16) * block_bytes
            assert f.usage["cached_tokens"] >= 144
            assert f.usage["kv_transfer_bytes"] < full - 8 * block_bytes  # the decode side already held the prefix
        wait_pools_empty(client)


def test_the_cluster_actors_live_in_the_pdserve_namespace(cluster):
    """Named in one known namespace, not the anonymous one of a bare ray.init: another driver (an
    operator's `ray.init(namespace="pdserve")`) finds them by name there, and Ray does not warn
    about a detached actor in an anonymous namespace for every worker started."""
    import ray

    from pdserve.launch.cluster import RAY_NAMESPACE

    mine = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(cluster.name)}
    assert len(mine) == 5, mine  # the router and the four workers
    assert set(mine.values()) == {RAY_NAMESPACE}


def test_the_embedded_ray_listens_on_loopback_only(cluster):
    """configs/local.yaml says `ray.node_ip_address: 127.0.0.1`: the Ray this process started (its
    GCS, raylet and every worker under them) listens there and nowhere else. ray.init alone
    swaps loopback for the host's reachable address, and its daemons listened on all interfaces."""
    import ipaddress

    import psutil
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = {(c.pid, c.laddr.ip) for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.pid in mine}
    assert listening, "no listening socket found under this process"
    exposed = {(pid, ip) for pid, ip in listening
               if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_ray_s_token_file_is_readable_by_its_owner_only(cluster):
    """Ray writes ~/.ray/auth_token world-readable; whoever read it could run code in this Ray."""
    import stat

    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not path.exists():
        pytest.skip("Ray runs without a token file here (RAY_AUTH_TOKEN, or authentication off)")
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, oct(path.stat().st_mode)


def test_engines_run_at_normal_priority(cluster, story):
    """Ray starts worker processes at nice 15; pdserve's workers come back to process.nice (0),
    so the thread that ran the engine's steps is not behind every other process on the host."""
    from tests.test_priority import _threads

    pids = cluster.worker_pids()
    before = {w: _threads(pid) for w, pid in pids.items()}
    io_nice, kv_nice = cluster.cfg.process.io_nice, cluster.cfg.process.kv_nice

    def threads_that_ran() -> dict[str, dict[int, int]]:
        ran = {}
        for w, pid in pids.items():
            after = _threads(pid)
            ran[w] = {t: nice for t, (nice, cpu) in after.items() if cpu > before[w].get(t, (0, 0))[1]}
        return {w: r for w, r in ran.items() if r}  # a worker this load did not reach is left out

    # CPU time is counted in 10 ms ticks, and a 300-token prefill of this tiny model takes less, so
    # the KV sender (at kv_nice) can register before the engine thread does: send distinct
    # prompts (no prefix hits) until every worker that ran shows a thread at nice 0, or give up.
    with RouterClient(cluster.address) as client, ThreadPoolExecutor(8) as pool:
        for rnd in range(8):
            offsets = [8 * rnd + i for i in range(8)]
            list(pool.map(lambda k: list(client.stream(
                make_request(story[k: k + 300], max_tokens=50, ignore_eos=True), timeout=60)), offsets))
            ran = threads_that_ran()
            if ran and all(0 in r.values() for r in ran.values()):
                break
    assert ran, "no worker thread ran the requests"
    for w, r in ran.items():
        # The engine thread at 0; serving threads at process.io_nice and KV transfer threads (which
        # can be the busiest under TLS with a tiny model) at process.kv_nice by design; none left
        # at Ray's 15.
        assert set(r.values()) <= {0, io_nice, kv_nice}, f"{w}: threads that ran, by nice: {r}"
        assert 0 in r.values(), f"{w}: no thread at nice 0 ran: {r}"


def test_sigkill_decode_worker_mid_stream(cluster, stories_path, story):
    """Runs last on each cluster: afterwards one decode worker is gone. Its streams resume on the
    other decode worker: every client gets the whole, identical answer and no error."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    prompts = [story[: 10 + i] for i in range(8)]
    refs = LLMEngine(EngineConfig(model=stories_path)).generate(
        prompts, SamplingParams(max_tokens=450, temperature=0, ignore_eos=True))
    pids = cluster.worker_pids()
    victim = "decode-0"
    results: dict[int, tuple[list[int], str]] = {}
    first_token = threading.Event()

    def run(i: int) -> None:
        with RouterClient(cluster.address) as client:
            tokens, started_on = [], ""
            for msg in client.stream(make_request(prompts[i], max_tokens=450, ignore_eos=True), timeout=120):
                first_token.set()
                started_on = started_on or msg.decode_worker
                tokens += msg.token_ids
            results[i] = (tokens, started_on)

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(run, i) for i in range(8)]
        assert first_token.wait(30)
        time.sleep(0.3)
        os.kill(pids[victim], signal.SIGKILL)
        for f in futs:
            f.result(120)  # no client saw an error
    assert any(started == victim for _, started in results.values()), "some requests were on the killed worker"
    for i, (tokens, _) in results.items():
        assert tokens == refs[i]["token_ids"], f"request {i} differs after failover"
    with RouterClient(cluster.address) as client:
        st = client.status()
        assert victim not in {w.worker_id for w in st.workers}
        outs = [client.generate(make_request(story[:20], max_tokens=10), timeout=60) for _ in range(4)]
        assert all(o.decode_worker != victim and o.finish_reason == "length" for o in outs)
        wait_pools_empty(client)
