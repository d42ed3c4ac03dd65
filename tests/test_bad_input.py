"""A client's mistake gets 400 / INVALID_ARGUMENT naming the field, never a 500 or a traceback;
a huge prompt is refused without stalling anyone else; overload says when to come back."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.client import make_request
from tests.cluster_utils import InProcessCluster, make_config


@pytest.fixture(scope="module")
def cluster(stories_path):
    with InProcessCluster(make_config(stories_path)) as c:
        yield c


def post(url: str, body: dict | bytes, timeout: float = 60) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if not raw.startswith(b"data:") else {}), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


COMPLETION_CASES = [
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": [1, 2**40]}, "prompt"),
    ({"prompt": [1, 512]}, "prompt"),
    ({"prompt": "\ud800 lone surrogate"}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**33}, "max_tokens"),
    ({"max_tokens": 513}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"stream": "no"}, "stream"),
    ({"stream_options": [1]}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"stop": 5}, "stop"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 129}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 10}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "two"}, "n"),
    ({"echo": "yes"}, "echo"),
    ({"suffix": "The end."}, "suffix"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"no_such_field": 1}, "no_such_field"),
]


@pytest.mark.parametrize("extra,param", COMPLETION_CASES, ids=[p + str(i) for i, (_, p) in
                                                              enumerate(COMPLETION_CASES)])
def test_bad_completion_field_is_a_400_naming_it(cluster, extra, param):
    body = {"prompt": "Once upon a time", "max_tokens": 4, **extra}
    status, out, _ = post(cluster.core.http_address + "/v1/completions", body)
    assert status == 400, out
    err = out["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") and param in err["message"]
    assert "Traceback" not in err["message"]


CHAT_CASES = [({"messages": "hi"}, "messages"), ({"messages": []}, "messages"),
              ({"messages": [{"content": "no role"}]}, "messages"), ({"logprobs": "yes"}, "logprobs"),
              ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"max_completion_tokens": 0},
                                                                         "max_completion_tokens")]


@pytest.mark.parametrize("extra,param", CHAT_CASES)
def test_bad_chat_field_is_a_400_naming_it(cluster, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    status, out, _ = post(cluster.core.http_address + "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == param, out


def test_off_values_of_unimplemented_fields_are_accepted(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "frequency_penalty": 0, "presence_penalty": 0.0,
            "best_of": 1, "n": 1, "echo": False, "logit_bias": None, "user": "me", "top_k": -1, "seed": 2**64 - 1}
    status, out, _ = post(cluster.core.http_address + "/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 4


def test_grpc_garbage_and_bad_values_are_invalid_argument(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        raw = ch.unary_stream("/pdserve.v1.Router/Generate")
        with pytest.raises(grpc.RpcError) as ei:
            list(raw(b"\xff\xff\xff\xff garbage", timeout=10))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in ei.value.details()
    with cluster.client() as c:
        for req, needle in [(make_request("hi", stop=["x"] * 65), "stop"), (make_request("hi", top_k=0), "top_k"),
                            (make_request("x" * 200_000), "characters")]:
            with pytest.raises(grpc.RpcError) as ei:
                c.generate(req, timeout=30)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in ei.value.details()


def test_prompt_logprobs_past_the_message_limit_are_refused_by_name(stories_path, story):
    """A prompt's logprobs come in one worker message: more than it can carry is an
    INVALID_ARGUMENT naming prompt_logprobs (HTTP: echo's logprobs), not a worker failure retried
    on every worker. Here the limit is 64 KiB: 400 tokens fit with 2 alternatives, not with 20."""
    with InProcessCluster(make_config(stories_path, **{"router.max_request_bytes": 65536})) as c, c.client() as cl:
        ok = cl.generate(make_request(story[:400], max_tokens=2, prompt_logprobs=2), timeout=30)
        assert ok.token_ids
        with pytest.raises(grpc.RpcError) as ei:
            cl.generate(make_request(story[:400], max_tokens=2, prompt_logprobs=20), timeout=30)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in ei.value.details()
        body = {"prompt": story[:400], "max_tokens": 2, "echo": True, "logprobs": 20}
        status, out, _ = post(c.core.http_address + "/v1/completions", body)
        assert status == 400 and "prompt_logprobs" in out["error"]["message"], out


def test_five_megabyte_prompt_is_refused_while_streams_continue(cluster, stories_path):
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        ["Once upon a time"], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))[0]["token_ids"]
    got: dict = {}

    def stream() -> None:
        with cluster.client() as c:
            got["out"] = c.generate(make_request("Once upon a time", max_tokens=300, ignore_eos=True), timeout=120)

    t = threading.Thread(target=stream)
    t.start()
    huge = "Once upon a time there was a big dog. " * (5 * 2**20 // 38)
    t0 = time.monotonic()
    status, out, _ = post(cluster.core.http_address + "/v1/completions", {"prompt": huge, "max_tokens": 4})
    refused_in = time.monotonic() - t0
    t.join(120)
    assert status == 400 and out["error"]["param"] == "prompt" or "characters" in out["error"]["message"], out
    assert refused_in < 5.0, f"the 5 MB prompt took {refused_in:.1f}s to refuse"
    assert got["out"].token_ids == ref, "the concurrent stream must finish untouched"
    with cluster.client() as c:  # nobody was dropped for a stalled event loop
        assert c.health().ready and len(c.status().workers) == 2


def test_overload_is_429_with_retry_after(stories_path, story):
    cfg = make_config(stories_path, **{"router.queue_size": 0, "decode.engine": {"num_kv_blocks": 34}})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        long = c.stream(make_request(story[:100], max_tokens=400, ignore_eos=True))  # 32 of the 34 blocks
        next(long)
        status, out, headers = post(cl.core.http_address + "/v1/completions",
                                    {"prompt": story[:100], "max_tokens": 100})
        long.cancel()
        assert status == 429 and out["error"]["type"] == "rate_limit_error"
        assert headers.get("Retry-After") == "1"
        cl.wait_idle()
