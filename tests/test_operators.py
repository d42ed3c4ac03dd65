"""What operators expect: OpenAI-compatible HTTP, Prometheus metrics, `pdserve bench`,
colocated mode. Real router and workers (in-process), real HTTP and gRPC clients."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.client import make_request
from tests.cluster_utils import InProcessCluster, make_config

ROOT = Path(__file__).resolve().parent.parent
@pytest.fixture(scope="module")
def cluster(stories_path):
    with InProcessCluster(make_config(stories_path)) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.core.http_address + "/v1", api_key="unused", max_retries=0)


def sse_events(url: str, body: dict) -> tuple[list[dict], dict]:
    """A raw server-sent-events reader: returns the JSON events and the response headers."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events, done = [], False
    with urllib.request.urlopen(req, timeout=60) as resp:
        headers = dict(resp.headers)
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                break
            events.append(json.loads(line[6:]))
    assert done, "stream must end with data: [DONE]"
    return events, headers


def test_completions_equal_grpc_path(cluster, oai):
    with cluster.client() as c:
        grpc_out = c.generate(make_request("Once upon a time", max_tokens=25))
    r = oai.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=25, temperature=0)
    assert r.choices[0].text == grpc_out.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 25 and r.usage.prompt_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # Token-id prompts work too, and the streamed pieces add up to the same text.
    stream = oai.completions.create(model="stories260K", prompt=[1, 403, 407, 261, 378], max_tokens=25,
                                    temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == grpc_out.text


def test_raw_sse_stream_usage_and_request_id(cluster):
    url = cluster.core.http_address + "/v1/completions"
    events, headers = sse_events(url, {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 12,
                                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    text_events = [e for e in events if e["choices"]]
    assert len(text_events) >= 2 and text_events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["id"] == headers["X-Request-Id"] for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 12
    # A client-chosen id is echoed back.
    req = urllib.request.Request(url, data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": "my-id-42"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["X-Request-Id"] == "my-id-42" and json.load(resp)["id"] == "my-id-42"


def test_shared_prefix_reports_cached_tokens(oai, story):
    prompt = story[:120]
    oai.completions.create(model="stories260K", prompt=prompt + [403], max_tokens=2)
    r = oai.completions.create(model="stories260K", prompt=prompt + [407], max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 112


def test_models_endpoint(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == ["stories260K"]


@pytest.mark.parametrize("kwargs,status,needle", [
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "context length"),
    ({"prompt": "hi", "temperature": -2}, 400, "temperature"),
    ({"prompt": "hi", "n": 129}, 400, "'n' must be an integer in [1, 128]"),
    ({"prompt": ["hi"] * 3, "n": 50}, 400, "3 prompt(s) x n is at most 128"),
    ({"prompt": ["hi", 3]}, 400, "list of strings or of token-id lists"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
])
def test_openai_errors(oai, kwargs, status, needle):
    kwargs = {"model": "stories260K", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as ei:
        oai.completions.create(**kwargs)
    assert ei.value.status_code == status and needle in ei.value.body["message"]
    assert {"message", "type", "param", "code"} <= set(ei.value.body)


def test_batched_prompts_and_n_samples(oai):
    """A list of prompts and n samples of each: choice index = prompt x n + sample (vLLM's order);
    each choice is what the same prompt alone gives; usage counts a prompt's tokens once."""
    kw = {"model": "stories260K", "max_tokens": 8, "temperature": 0}
    alone = [oai.completions.create(prompt=p, **kw) for p in ("Once upon a time", "The dog")]
    r = oai.completions.create(prompt=["Once upon a time", "The dog"], **kw)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    # Sampled: seed + j for sample j, so the samples differ and the request reproduces.
    kw = {"model": "stories260K", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    r = oai.completions.create(prompt=["Once", [1, 403]], n=3, **kw)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == list(range(6)) and len(set(texts[:3])) > 1
    assert texts == [c.text for c in oai.completions.create(prompt=["Once", [1, 403]], n=3, **kw).choices]
    once = oai.completions.create(prompt="Once", **kw)
    assert texts[0] == once.choices[0].text  # sample 0: the seed itself
    assert r.usage.prompt_tokens == once.usage.prompt_tokens + 2 and r.usage.completion_tokens == 6 * 12
    # Streamed: every choice's pieces add up to its text, each ends, and usage comes once, last.
    stream = list(oai.completions.create(prompt=["Once", [1, 403]], n=3, stream=True,
                                         stream_options={"include_usage": True}, **kw))
    got, ends = [""] * 6, set()
    for ch in stream[:-1]:
        assert ch.usage is None and len(ch.choices) == 1
        got[ch.choices[0].index] += ch.choices[0].text
        if ch.choices[0].finish_reason:
            ends.add(ch.choices[0].index)
    assert got == texts and ends == set(range(6))
    assert not stream[-1].choices and stream[-1].usage.completion_tokens == 6 * 12


def test_best_of_returns_the_likeliest_samples(oai):
    """best_of=k: k samples of each prompt (sample j drawing from seed + j, as with n), of which
    the n with the highest summed logprob come back, numbered 0..n-1 per prompt; usage counts all."""
    kw = {"model": "stories260K", "prompt": "Once", "max_tokens": 12, "temperature": 1.0, "logprobs": 0}
    singles = [oai.completions.create(seed=5 + j, **kw).choices[0] for j in range(4)]
    ranked = sorted(singles, key=lambda c: -sum(c.logprobs.token_logprobs))
    r = oai.completions.create(seed=5, best_of=4, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == [c.text for c in ranked[:2]]
    assert r.usage.completion_tokens == 4 * 12
    # logprobs: 0 is the chosen tokens' own logprobs, no alternatives (it once returned none at all).
    lp = singles[0].logprobs
    pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert len(lp.token_logprobs) == 12 and all(list(t.values()) == [v] for t, v in pairs)
    with pytest.raises(openai.BadRequestError, match="stream"):
        oai.completions.create(seed=5, best_of=2, stream=True, **kw)


def test_penalties_through_the_cluster_equal_the_engine(oai, stories_path):
    """Penalties on the disaggregated path (the first token sampled on the prefill worker, the
    rest on the decode worker, streamed and not) give what one engine gives."""
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play"
    pen = {"presence_penalty": 0.4, "frequency_penalty": 0.8, "repetition_penalty": 1.1}
    eng = LLMEngine(EngineConfig(model=stories_path))
    ref = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0, **pen))[0]["text"]
    plain = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]["text"]
    kw = {"model": "stories260K", "prompt": prompt, "max_tokens": 30, "temperature": 0}
    r = oai.completions.create(**kw, presence_penalty=0.4, frequency_penalty=0.8,
                               extra_body={"repetition_penalty": 1.1})  # vLLM's field, not OpenAI's
    assert r.choices[0].text == ref != plain
    stream = oai.completions.create(**kw, extra_body=pen, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == ref
    # logit_bias (JSON keys are strings): the greedy continuation's first token banned.
    first = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]["token_ids"][0]
    ban = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0, logit_bias={first: -100}))[0]["text"]
    assert oai.completions.create(**kw, logit_bias={str(first): -100}).choices[0].text == ban != plain


def test_echo_returns_the_prompt_and_its_logprobs(oai, stories_path):
    """echo: the prompt's text ahead of the completion's and, with logprobs, the prompt tokens'
    (computed by the prefill worker; the first token's is null, as OpenAI and vLLM give it), as
    one engine's prompt_logprobs; streamed, the first event carries them. What lm-eval-harness's
    loglikelihood tasks ask a completions server for."""
    prompt = "Once upon a time, there was a little girl"
    eng = LLMEngine(EngineConfig(model=stories_path))
    ids = eng.tokenize(prompt)
    ref = eng.generate([ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))[0]
    kw = {"model": "stories260K", "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}
    r = oai.completions.create(**kw, logprobs=2).choices[0]
    assert r.text == prompt + ref["text"]
    lp = r.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], ref["prompt_logprobs"], strict=True)) < 1e-5
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert oai.completions.create(**kw).choices[0].text == prompt + ref["text"]  # echo alone: no logprobs needed
    events = list(oai.completions.create(**kw, logprobs=0, stream=True))
    assert "".join(e.choices[0].text for e in events) == prompt + ref["text"]
    first = events[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and first.tokens[:len(ids)] == lp.tokens[:len(ids)]
    two = oai.completions.create(**{**kw, "prompt": [prompt, ids[:4]]}, logprobs=1).choices  # a batch, ids too
    assert two[0].text == r.text and two[1].logprobs.tokens[:4] == lp.tokens[:4]
    assert two[1].logprobs.token_logprobs[:4] == pytest.approx(lp.token_logprobs[:4], abs=1e-5)
    # max_tokens 0 with echo scores the prompt alone (vLLM's way); without echo it is still refused.
    for stream in (False, True):
        got = oai.completions.create(**{**kw, "max_tokens": 0}, logprobs=1, stream=stream)
        c = next(iter(got)).choices[0] if stream else got.choices[0]
        assert c.text == prompt and c.logprobs.tokens == lp.tokens[:len(ids)] and c.finish_reason == "length"
    assert oai.completions.create(**{**kw, "max_tokens": 0}).usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(**{**kw, "max_tokens": 0, "echo": False})


def test_chat_without_template_is_a_clear_error(oai):
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}])
    assert "no chat template" in ei.value.body["message"]


def test_chat_completions_apply_the_template(chat_model):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    with InProcessCluster(make_config(chat_model)) as cl:
        client = openai.OpenAI(base_url=cl.core.http_address + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="stories-chat", messages=msgs, max_tokens=15, temperature=0)
        stream = client.chat.completions.create(model="stories-chat", messages=msgs, max_tokens=15, temperature=0,
                                                stream=True)
        chunks = list(stream)
        two = client.chat.completions.create(model="stories-chat", messages=msgs, max_tokens=15, temperature=0, n=2)
        two_chunks = list(client.chat.completions.create(model="stories-chat", messages=msgs, max_tokens=15,
                                                         temperature=0, n=2, stream=True))
    eng = LLMEngine(EngineConfig(model=chat_model))
    text = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = list(eng.tokenizer(text, add_special_tokens=False).input_ids)
    ref = eng.generate([ids], SamplingParams(max_tokens=15, temperature=0))[0]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref["text"]
    assert [(c.index, c.message.content) for c in two.choices] == [(0, ref["text"]), (1, ref["text"])]
    for i in (0, 1):  # streamed: each choice opens with the role, and its pieces add up
        mine = [c.choices[0].delta for c in two_chunks if c.choices[0].index == i]
        assert mine[0].role == "assistant" and "".join(d.content or "" for d in mine) == ref["text"]


def metrics(cluster) -> dict[str, list]:
    text = urllib.request.urlopen(cluster.core.http_address + "/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def sample(fams: dict, family: str, suffix: str = "", **labels) -> float:
    for s in fams[family]:
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, suffix, labels))


def test_prometheus_metrics_agree_with_requests(stories_path):
    with InProcessCluster(make_config(stories_path)) as cl, cl.client() as c:
        n = 5
        outs = [c.generate(make_request("Once upon a time", max_tokens=10)) for _ in range(n)]
        with pytest.raises(grpc.RpcError):
            c.generate(make_request("", max_tokens=3))
        met, missed = make_request("Once upon a", max_tokens=3), make_request("Once upon", max_tokens=3)
        met.slo.ttft_ms, met.slo.tpot_ms = 60_000, 60_000
        missed.slo.ttft_ms = 0.001
        c.generate(met), c.generate(missed)
        stream = c.stream(make_request("Once upon a time", max_tokens=400, ignore_eos=True))
        next(stream)
        stream.cancel()  # the client goes away: counted as an abort
        cl.wait_idle()
        time.sleep(0.8)  # one heartbeat for worker-side figures
        fams = metrics(cl)
    kv_bytes = sum(o.usage["kv_transfer_bytes"] for o in outs)
    assert sample(fams, "pdserve:time_to_first_token_seconds", "_count") == n + 2
    assert sample(fams, "pdserve:e2e_request_latency_seconds", "_count") == n + 2
    assert sample(fams, "pdserve:kv_transfer_seconds", "_count") == n + 2
    assert sample(fams, "pdserve:inter_token_latency_seconds", "_count") == n * 9 + 2 * 2
    # One at a time, each decoded alone (batch 1): the figure the planner's decode correction reads.
    assert sample(fams, "pdserve:request_decode_batch", "_count") == n + 2
    assert sample(fams, "pdserve:request_decode_batch", "_sum") == n + 2
    assert sample(fams, "pdserve:kv_transfer_bytes", "_total") >= kv_bytes > 0
    assert sample(fams, "pdserve:request_success", "_total", finished_reason="length") == n + 2
    assert sample(fams, "pdserve:request_success", "_total", finished_reason="abort") == 1
    assert sample(fams, "pdserve:request_failure", "_total", code="INVALID_ARGUMENT") == 1
    assert sample(fams, "pdserve:request_slo", "_total", outcome="none") == n
    assert sample(fams, "pdserve:request_slo", "_total", outcome="met") == 1
    assert sample(fams, "pdserve:request_slo", "_total", outcome="missed") == 1
    assert sample(fams, "pdserve:generation_tokens", "_total") == 10 * n + 2 * 3
    assert sample(fams, "pdserve:num_replicas", "", pool="prefill") == 1
    assert sample(fams, "pdserve:num_replicas", "", pool="decode") == 1
    assert sample(fams, "pdserve:num_requests_running", "", pool="decode") == 0
    assert sample(fams, "pdserve:num_requests_waiting", "", pool="router") == 0
    assert sample(fams, "pdserve:kv_cache_usage_perc", "", pool="decode", worker="decode-0") == 0
    # The decode engine stepped at least once per token after the first of each request (9 and 2
    # of them, and the cancelled stream's), and timed those steps.
    decode_steps = sample(fams, "pdserve:engine_steps", "_total", pool="decode", worker="decode-0")
    assert decode_steps >= 9 * n + 2 * 2
    assert 0 < sample(fams, "pdserve:engine_busy_seconds", "_total", pool="decode", worker="decode-0") < 60
    assert sample(fams, "pdserve:engine_steps", "_total", pool="prefill", worker="prefill-0") >= n + 3
    # Every prompt was looked up once in the prefill worker's prefix cache (3 to 5 tokens each).
    assert sample(fams, "pdserve:prefix_cache_queries", "_total") == 5 * n + 4 + 3 + 5
    assert sample(fams, "pdserve:prefix_cache_hits", "_total") == 0
    # The router process's standard figures beside pdserve's own.
    assert sample(fams, "process_resident_memory_bytes") > 0 and sample(fams, "process_cpu_seconds", "_total") > 0
    assert sample(fams, "python_gc_collections", "_total", generation="2") >= 0
    assert sample(fams, "python_info")


def test_pdserve_bench_json_is_consistent(cluster, tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "--router", cluster.address,
                        "--num-prompts", "12", "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5",
                        "--shared-prefix-len", "16", "--request-rate", "30", "--slo-ttft-ms", "1000",
                        "--slo-tpot-ms", "1000", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "bench.json").read_text())
    s = report["summary"]
    assert s["completed"] + s["failed"] == 12 == len(report["requests"]) and s["failed"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = s[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"]
    assert s["goodput"] <= s["request_throughput"] + 1e-9
    assert s["goodput_requests"] == 12  # generous SLO: all meet it
    assert sum(r["output_len"] for r in report["requests"]) == round(s["output_throughput"] * s["duration_s"])
    assert all(r["ttft"] <= r["e2e"] for r in report["requests"])
    assert (out / "bench.png").stat().st_size > 1000
    assert "TTFT" in r.stdout and "goodput" in r.stdout
    assert "12/12 requests done" in r.stderr and "\r" not in r.stderr  # a log, not a redrawn bar


def test_pdserve_bench_http_sweep(cluster, tmp_path):
    out = tmp_path / "sweep.json"  # a .json path: the plots go beside it, named after it
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "--backend", "http", "--url",
                        cluster.core.http_address, "--num-prompts", "6", "--input-len", "16", "--output-len", "6",
                        "--sweep", "10,40", "--slo-ttft-ms", "0.001", "--temperature", "0.8", "--top-p", "0.9",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    sweep = json.loads(out.read_text())["sweep"]
    assert [s["config"]["load"]["request_rate"] for s in sweep] == [10, 40]
    assert {(s["config"]["workload"]["temperature"], s["config"]["workload"]["top_p"]) for s in sweep} == {(0.8, 0.9)}
    assert all(s["summary"]["failed"] == 0 for s in sweep)
    assert all(s["summary"]["goodput"] == 0 for s in sweep)  # an impossible TTFT SLO: nobody meets it
    assert (tmp_path / "sweep_goodput_vs_rate.png").exists() and (tmp_path / "sweep_rate40.png").exists()
    assert "within TTFT<=0.001 ms" in r.stdout


def test_colocated_mode_matches_engine(stories_path, story):
    cfg = make_config(stories_path, **{"mode": "colocated", "colocated.replicas": 2})
    prompts = [story[: 3 + 17 * i] for i in range(6)]
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    asked = LLMEngine(EngineConfig(model=stories_path)).generate(
        prompts[3:4], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1))[0]["prompt_logprobs"]
    with InProcessCluster(cfg) as cl, cl.client() as c:
        outs = [c.generate(make_request(p, max_tokens=20)) for p in prompts]
        # Prompt logprobs from a prompt prefilled where it decodes: on its gRPC stream, not the
        # direct token socket, which carries none (pdcommon/engine_loop.py).
        first = next(iter(c.stream(make_request(prompts[3], max_tokens=3, prompt_logprobs=1), timeout=30)))
        st = c.status()
        cl.wait_idle()
    assert list(first.prompt_logprobs) == pytest.approx(asked, abs=1e-5) and len(asked) == len(prompts[3]) - 1
    assert [o.token_ids for o in outs] == [r["token_ids"] for r in ref]
    assert all(o.usage["kv_transfer_bytes"] == 0 and o.prefill_worker == o.decode_worker for o in outs)
    assert st.mode == "colocated" and {w.role for w in st.workers} == {"colocated"} and len(st.workers) == 2


def test_structured_logs_carry_request_ids(cluster, caplog):
    from pdcommon.logs import JsonFormatter

    with caplog.at_level("INFO", logger="router.core"), cluster.client() as c:
        out = c.generate(make_request("Once upon a time", max_tokens=3, request_id="log-me-1"))
    records = [r for r in caplog.records if getattr(r, "request_id", None) == "log-me-1"]
    assert records and out.finish_reason
    line = json.loads(JsonFormatter().format(records[-1]))
    assert line["request_id"] == "log-me-1" and line["msg"] == "request finished"
    assert line["completion_tokens"] == 3 and line["decode_worker"] == "decode-0" and line["level"] == "INFO"


def post_json(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_retrieve(oai):
    listed = oai.models.list().data[0]
    got = oai.models.retrieve(listed.id)
    assert got.id == listed.id == "stories260K"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_logprob_tokens_are_text_with_offsets(oai, stories_path):
    out = oai.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=12, temperature=0,
                                 logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text  # tokens as text, spaces included (' there', not '▁there')
    assert not any("\u2581" in t for t in lp.tokens) and any(t.startswith(" ") for t in lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 3 and not any("\u2581" in k for k in top) for top in lp.top_logprobs)
    streamed = oai.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=12, temperature=0,
                                      logprobs=1, stream=True)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset  # offsets run on across chunks


def test_tokenize_and_detokenize(cluster):
    base = cluster.core.http_address
    status, body = post_json(base + "/tokenize", {"prompt": "Once upon a time"})
    assert status == 200 and body["tokens"] == [1, 403, 407, 261, 378] and body["count"] == 5
    assert body["max_model_len"] == 512
    status, body = post_json(base + "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False})
    assert body["tokens"] == [403, 407, 261, 378]
    status, body = post_json(base + "/detokenize", {"tokens": [403, 407, 261, 378]})
    assert status == 200 and body["prompt"] == "Once upon a time"
    status, body = post_json(base + "/detokenize", {"tokens": [1, 99999]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = post_json(base + "/tokenize", {"prompt": "x", "model": "other"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
