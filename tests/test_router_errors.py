"""Router behaviour on a real (in-process) cluster: bad input, cancellation, deadlines,
admission when decode is full, failed transfers. Every test ends with all pools empty."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.client import make_request
from pdcommon.v1 import router_pb2 as pb
from tests.cluster_utils import InProcessCluster, make_config, send_once


@pytest.fixture(scope="module")
def cluster(stories_path):
    cfg = make_config(stories_path, **{"router.request_timeout_s": 30})
    with InProcessCluster(cfg) as c:
        yield c


@pytest.fixture(autouse=True)
def pools_empty_after(request):
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").wait_idle()


def rpc_error(client, req, timeout=30) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        client.generate(req, timeout=timeout)
    return ei.value


def test_generate_matches_engine(cluster, stories_path):
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        ["Once upon a time"], SamplingParams(max_tokens=30, temperature=0))[0]
    with cluster.client() as c:
        out = c.generate(make_request("Once upon a time", max_tokens=30))
    assert out.token_ids == ref["token_ids"] and out.text == ref["text"]
    assert out.finish_reason == "length" and out.usage["completion_tokens"] == 30 and out.usage["prompt_tokens"] == 5
    for key in ("queue", "prefill", "kv_transfer", "ttft", "tpot", "e2e"):
        assert out.timings[key] >= 0
    assert 0 < out.timings["ttft"] <= out.timings["e2e"]
    assert out.chunks > 2  # streamed, not one blob


def test_kv_transfer_time_leaves_out_the_prefill(stories_path):
    """timings.kv_transfer (and pdserve:kv_transfer_seconds) is the transfer's own time. The
    decode reservation is made before the prompt is computed, and timed from there it held the
    whole prefill: the demo showed 9.8 ms of "KV transfer" for 20 KiB. Device emulation makes the
    prefill take ~0.6 s here, so the two cannot be confused."""
    cfg = make_config(stories_path, **{"engine.emulate_device_s_per_token": 0.002})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        out = c.generate(make_request([5 + i % 400 for i in range(300)], max_tokens=3))
    assert out.usage["kv_transfer_bytes"] > 0 and out.timings["prefill"] > 0.5, (out.usage, out.timings)
    assert 0 < out.timings["kv_transfer"] < 0.5 * out.timings["prefill"], out.timings


@pytest.mark.parametrize("req,needle", [
    (make_request(""), "prompt is empty"),
    (make_request([]), "prompt is empty"),
    (pb.GenerateRequest(), "no prompt"),
    (make_request("hi", max_tokens=600), "context length 512"),
    (make_request([1] * 500, max_tokens=20), "context length 512"),
    (make_request("hi", temperature=-1.0), "temperature"),
    (make_request("hi", top_p=1.5), "top_p"),
    (make_request("hi", top_k=-5), "top_k"),
    (make_request("hi", max_tokens=0), "max_tokens"),
    (make_request([1, 99999]), "vocabulary"),
])
def test_bad_input_gets_invalid_argument(cluster, req, needle):
    with cluster.client() as c:
        err = rpc_error(c, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.details()


def test_duplicate_request_id(cluster):
    with cluster.client() as c:
        stream = c.stream(make_request("Once upon a time", max_tokens=300, ignore_eos=True, request_id="dup"))
        next(stream)
        err = rpc_error(c, make_request("hi", request_id="dup"))
        stream.cancel()
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS


# Cancellation and deadlines: tests/test_cancel_real_work.py (decode slowed by real work, so a
# request that was not freed would still hold its blocks long after the 2 s bound).


def test_scale_without_launcher_is_failed_precondition(cluster):
    with cluster.control_client() as c, pytest.raises(grpc.RpcError) as ei:
        c.scale("decode", 2)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_health_and_status(cluster):
    with cluster.client() as c:
        h = c.health()
        st = c.status()
    assert h.ready and h.prefill_workers == 1 and h.decode_workers == 1
    assert {w.role for w in st.workers} == {"prefill", "decode"} and st.transport == "zmq"


def slow_decode(cluster, delay_s: float = 0.03) -> None:
    """Make the decode worker's steps slow so a request holds its blocks for seconds."""
    for rt in cluster.runtimes():
        if rt.role == "decode":
            step = rt.engine.step
            rt.engine.step = lambda step=step: (time.sleep(delay_s), step())[1]


def test_full_decode_pool_queues_then_resource_exhausted(stories_path):
    # 8 blocks of 16 tokens on the decode side: one 100-token request takes 7 of them.
    cfg = make_config(stories_path, **{"router.request_timeout_s": 1.5, "decode.engine": {"num_kv_blocks": 8}})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        slow_decode(cl)
        long = c.stream(make_request("Once upon a time", max_tokens=100, ignore_eos=True))
        next(long)
        t0 = time.monotonic()
        err = rpc_error(c, make_request("Once upon a time", max_tokens=40))
        waited = time.monotonic() - t0
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no decode worker had room" in err.details()
        assert waited >= 1.0  # it queued until its deadline rather than failing at once
        # Once the long one is gone, the same request is admitted (short: decode is slowed down).
        long.cancel()
        cl.wait_idle()
        out = c.generate(make_request("Once upon a time", max_tokens=8))
        assert out.finish_reason == "length"
        cl.wait_idle()
    cfg = make_config(stories_path, **{"router.queue_size": 0, "decode.engine": {"num_kv_blocks": 8}})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        slow_decode(cl)
        long = c.stream(make_request("Once upon a time", max_tokens=100, ignore_eos=True))
        next(long)
        err = rpc_error(c, make_request("Once upon a time", max_tokens=40))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.details()
        long.cancel()
        cl.wait_idle()


class CorruptingSender:
    """Wraps the prefill worker's real sender and flips one byte of the first `n` transfers."""

    def __init__(self, inner, n: int) -> None:
        self.inner, self.left = inner, n
        self.lock = threading.Lock()

    def send(self, dest, header, frames, timeout_s, **kw):
        with self.lock:
            corrupt, self.left = self.left > 0, self.left - 1
        if corrupt:
            from transfer import fill_checksums

            fill_checksums(header, frames)  # checksums of the clean data: the damage happens "on the wire"
            bad = bytearray(frames[0])
            bad[0] ^= 0xFF
            frames = [memoryview(bad), *frames[1:]]
        return self.inner.send(dest, header, frames, timeout_s, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _corrupt(cluster, n: int) -> None:
    for rt in cluster.runtimes():
        if rt.role == "prefill":
            rt.service.shipper.sender = CorruptingSender(rt.service.shipper.sender, n)


def test_corrupt_transfer_is_rejected_then_retried(stories_path):
    cfg = make_config(stories_path, **{"router.max_retries": 1})
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        ["Once upon a time there was"], SamplingParams(max_tokens=20, temperature=0))[0]
    with InProcessCluster(cfg) as cl, cl.client() as c:
        _corrupt(cl, 1)
        out = c.generate(make_request("Once upon a time there was", max_tokens=20))
        assert out.token_ids == ref["token_ids"]  # the retry shipped clean blocks
        _corrupt(cl, 2)
        err = rpc_error(c, make_request("Once upon a time there was", max_tokens=20))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "checksum" in err.details()
        cl.wait_idle()


def test_stale_attempt_transfer_is_refused(cluster):
    """KV from an earlier attempt of a retried request never lands in the retry's reservation."""
    from pdcommon.convert import params_to_proto
    from pdcommon.v1 import worker_pb2 as wpb
    from pdcommon.v1 import worker_pb2_grpc as wrpc
    from transfer import TransferState, build_header

    dec = next(w for w in cluster.core.members.workers.values() if w.role == "decode")
    layout = next(rt for rt in cluster.runtimes() if rt.role == "decode").engine.kv_layout
    identity, key = cluster.core.identity, b"k" * 32  # the test plays the router: it holds the secret
    with identity.channel(dec.address) as ch:
        call = wrpc.DecodeWorkerStub(ch).Decode(wpb.DecodeRequest(
            request_id="stale-1", prompt_token_ids=[1, 403, 407, 261, 378], attempt=1, transfer_timeout_s=10,
            sampling=params_to_proto(SamplingParams(max_tokens=4, temperature=0)), transfer_key=key),
            metadata=identity.metadata)
        assert next(call).reservation.ok
        frame = memoryview(bytes(layout.block_nbytes))
        header = build_header("stale-1", layout.dtype, list(layout.block_shape), frame.nbytes, [None], [frame], [1],
                              meta={"attempt": 0, "first_token": 5, "first_logprob": 0.0})
        h = send_once("zmq", dec.transfer_address, header, [frame], key=key)
        assert h.state is TransferState.FAILED and "stale transfer of attempt 0" in h.error
        call.cancel()
    cluster.wait_idle()


class DroppingSender(CorruptingSender):
    """Pretends to send the first `n` transfers but never does: the decode side must time out."""

    def send(self, dest, header, frames, timeout_s, **kw):
        with self.lock:
            drop, self.left = self.left > 0, self.left - 1
        if drop:
            from transfer import TransferHandle

            return TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)
        return self.inner.send(dest, header, frames, timeout_s, **kw)


def test_lost_transfer_times_out_frees_blocks_and_retries(stories_path):
    cfg = make_config(stories_path, **{"router.max_retries": 1, "transfer.timeout_s": 1.0})
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        ["Once upon a time there was"], SamplingParams(max_tokens=10, temperature=0))[0]
    with InProcessCluster(cfg) as cl, cl.client() as c:
        for rt in cl.runtimes():
            if rt.role == "prefill":
                rt.service.shipper.sender = DroppingSender(rt.service.shipper.sender, 1)
        t0 = time.monotonic()
        out = c.generate(make_request("Once upon a time there was", max_tokens=10), timeout=30)
        assert out.token_ids == ref["token_ids"] and time.monotonic() - t0 >= 1.0  # the retry after the timeout
        for rt in cl.runtimes():
            if rt.role == "prefill":
                rt.service.shipper.sender = DroppingSender(rt.service.shipper.sender.inner, 2)
        err = rpc_error(c, make_request("Once upon a time there was", max_tokens=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "did not arrive" in err.details()
        cl.wait_idle()
