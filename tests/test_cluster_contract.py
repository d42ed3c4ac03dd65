"""What the cluster promises across the prefill/decode split: seeded sampling equals the engine
alone (after a retry too), bf16 KV survives the wire, workers of another model are refused,
and config mistakes fail at load time naming the key."""

from __future__ import annotations

import warnings

import pytest
from pydantic import ValidationError

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.client import make_request
from pdcommon.config import load_config
from pdcommon.convert import layout_to_proto
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc
from tests.cluster_utils import InProcessCluster, make_config
from tests.test_operators import metrics, sample
from tests.test_router_errors import _corrupt

PROMPT = "Once upon a time there was a"


def _engine_alone(path: str, params: SamplingParams, **cfg) -> dict:
    return LLMEngine(EngineConfig(model=path, **cfg)).generate([PROMPT], params)[0]


def test_seeded_sampling_across_the_split_equals_engine_alone(stories_path):
    params = dict(max_tokens=40, temperature=0.9, top_p=0.95, top_k=40, ignore_eos=True)
    refs = {seed: _engine_alone(stories_path, SamplingParams(seed=seed, **params))["token_ids"] for seed in (7, 8)}
    assert refs[7] != refs[8], "two seeds should draw different stories"
    cfg = make_config(stories_path, **{"router.max_retries": 1})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        for seed, ref in refs.items():
            assert c.generate(make_request(PROMPT, seed=seed, **params)).token_ids == ref
        _corrupt(cl, 1)  # the first transfer is rejected: the request is prefilled again and retried
        out = c.generate(make_request(PROMPT, seed=7, **params))
        assert out.token_ids == refs[7]
        cl.wait_idle()


def test_one_token_request_ends_at_the_prefill_without_a_decode_reservation(stories_path):
    ref = _engine_alone(stories_path, SamplingParams(max_tokens=1, temperature=0))["token_ids"]
    with InProcessCluster(make_config(stories_path)) as cl, cl.client() as c:
        decode = next(rt for rt in cl.runtimes() if rt.role == "decode")
        served = decode.served
        for _ in range(3):
            out = c.generate(make_request(PROMPT, max_tokens=1))
            assert out.token_ids == ref and out.finish_reason == "length"
            assert out.prefill_worker and not out.decode_worker
        assert decode.served == served, "a 1-token request reserved decode capacity"
        two = c.generate(make_request(PROMPT, max_tokens=2))  # longer ones still go through decode
        assert two.decode_worker and decode.served == served + 1
        cl.wait_idle()


def test_short_prompts_prefill_on_their_decode_worker_when_configured(stories_path, story):
    """router.local_prefill_max_tokens: a prompt up to that length is computed by the decode
    worker that streams it (nothing ships), a longer one by the prefill pool; the same tokens
    as the engine alone either way."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    long_prompt = story[:100]
    ref_short, ref_long = (o["token_ids"] for o in
                           LLMEngine(EngineConfig(model=stories_path)).generate([PROMPT, long_prompt], params))
    with InProcessCluster(make_config(stories_path, **{"router.local_prefill_max_tokens": 32})) as cl, \
            cl.client() as c:
        assert len(c.generate(make_request(PROMPT, max_tokens=1)).token_ids) == 1  # 1 token: the prefill pool
        short = c.generate(make_request(PROMPT, max_tokens=20, ignore_eos=True))
        assert short.token_ids == ref_short
        assert short.prefill_worker == short.decode_worker and short.prefill_worker.startswith("decode")
        assert not short.usage["kv_transfer_bytes"]
        long = c.generate(make_request(long_prompt, max_tokens=20, ignore_eos=True))
        assert long.token_ids == ref_long
        assert long.prefill_worker.startswith("prefill") and long.usage["kv_transfer_bytes"] > 0
        assert sample(metrics(cl), "pdserve:local_prefills", "_total") == 1  # the short one alone
        cl.wait_idle()


def test_bfloat16_kv_across_the_wire_equals_engine_alone(stories_path, story):
    """100 prompt tokens (7 blocks, shipped in 3 frames): a short prompt would not do, since the
    tiny model continues "Once upon a time" the same way even with its KV zeroed."""
    prompt = story[:100]
    ref = LLMEngine(EngineConfig(model=stories_path, dtype="bfloat16")).generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    block = 5 * 2 * 16 * 4 * 8 * 2  # layers x (K, V) x block_size x kv_heads x head_dim x bf16
    cfg = make_config(stories_path, **{"engine.dtype": "bfloat16", "transfer.max_frame_bytes": 3 * block})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        out = c.generate(make_request(prompt, max_tokens=30, ignore_eos=True))
        assert out.token_ids == ref["token_ids"]
        assert out.usage["kv_transfer_bytes"] == 7 * block
        assert 0 < out.timings["prefill"] < out.timings["ttft"]  # carried on the first token's output
        cl.wait_idle()


def _register(cl, info: wpb.WorkerInfo) -> wpb.RegisterReply:
    identity = cl.core.identity  # a member's credentials: what is checked here is the worker's fit
    with identity.channel(cl.router.control_address) as ch:
        return wrpc.ControlStub(ch).Register(info, timeout=10, metadata=identity.metadata)


def test_workers_of_another_model_or_layout_are_refused(stories_path):
    cfg = make_config(stories_path)
    with InProcessCluster(cfg) as cl:
        core = cl.core
        good = wpb.WorkerInfo(worker_id="intruder", role="decode", address="127.0.0.1:1", block_size=16,
                              num_blocks=8, model="stories260K", model_fingerprint=core.model.fingerprint,
                              kv_layout=layout_to_proto(core.layouts["decode"]))
        other_model = wpb.WorkerInfo()
        other_model.CopyFrom(good)
        other_model.model_fingerprint = "0" * 32
        reply = _register(cl, other_model)
        assert not reply.accepted and "config.json or tokenizer differ" in reply.message
        other_layout = wpb.WorkerInfo()
        other_layout.CopyFrom(good)
        other_layout.kv_layout.dtype = "bfloat16"
        reply = _register(cl, other_layout)
        assert not reply.accepted and "KV layout" in reply.message and "bfloat16" in reply.message
        assert "intruder" not in core.members.workers
        # A live worker's id is never repointed: not even a member may take it over from another address.
        live = core.members.workers["decode-0"]
        repoint = wpb.WorkerInfo()
        repoint.CopyFrom(good)
        repoint.worker_id, repoint.incarnation = "decode-0", "another-process"
        reply = _register(cl, repoint)
        assert not reply.accepted and "belongs to a live worker" in reply.message
        assert core.members.workers["decode-0"] is live and live.address != repoint.address


def test_per_pool_override_typo_fails_at_load_naming_the_key():
    with pytest.raises(ValidationError, match=r"decode\.engine\.max_num_seq\b"):
        load_config(None, **{"decode.engine.max_num_seq": 8})
    with pytest.raises(ValidationError, match="max_num_seqs"):
        load_config(None, **{"engine.max_num_seqs": 0})  # the engine's own range check, at load time
    with pytest.raises(ValidationError, match="KV blocks must have one layout"):
        load_config(None, **{"prefill.engine.block_size": 32})
    cfg = load_config(None, **{"decode.engine.max_num_seqs": 8})
    assert cfg.engine_config("decode").max_num_seqs == 8 and cfg.engine_config("prefill").max_num_seqs == 256


def test_deprecated_key_warns_and_null_override_applies(tmp_path):
    f = tmp_path / "old.yaml"
    f.write_text("transfer:\n  transport: zmq\n  hwm: 1024\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(f, **{"router.http_port": None})
    assert any("transfer.hwm" in str(w.message) for w in caught)
    assert cfg.router.http_port is None  # None turns HTTP off rather than being skipped
