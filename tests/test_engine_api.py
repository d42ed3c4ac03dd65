"""Sampling, stop conditions, detokenization and clear errors for bad input or bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, TextStream
from engine.loader import load_tokenizer, resolve_model_path
from engine.sampler import sample


@pytest.fixture(scope="module")
def eng(stories_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=stories_path))


def test_seeded_sampling_is_batch_independent(eng):
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = eng.generate(["Once upon a time"], p)[0]["token_ids"]
    others = [SamplingParams(max_tokens=20, temperature=1.3, seed=s) for s in range(5)]
    batch = eng.generate(["Tom had a", "Once upon a time", "The sun", "A cat", "Mia", "Big"],
                         [others[0], p, *others[1:]])
    assert batch[1]["token_ids"] == alone
    assert len({tuple(b["token_ids"]) for b in batch}) > 1


def test_seeded_row_alone_and_in_batch_draws_same_token():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 512, generator=g)
    batch = torch.cat([torch.randn(3, 512, generator=g), row, torch.randn(2, 512, generator=g)])
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=99)
    others = [SamplingParams(temperature=1.0, seed=i) for i in range(5)]

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    alone, _, _ = sample(row, [p], [gen(99)])
    params = others[:3] + [p] + others[3:]
    gens = [gen(i) for i in range(3)] + [gen(99)] + [gen(i) for i in range(3, 5)]
    together, _, _ = sample(batch, params, gens)
    assert together[3] == alone[0]


def test_draws_follow_the_tempered_distribution_and_skip_filtered_tokens():
    # 6 tokens, then a tail that top_k removes: the draws must match softmax(logits / T) over the
    # 6 (each frequency within 4.5 standard errors over 24000 draws, 32 rows a batch) and never
    # land in the tail. (Seen failing with the temperature left out.)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0] + [-50.0] * 58)
    temp = 0.7
    want = torch.softmax(logits[:6] / temp, dim=-1)
    p = SamplingParams(temperature=temp, top_k=6)
    counts = torch.zeros(64)
    for b in range(750):
        gens = [torch.Generator().manual_seed(1000 * b + i) for i in range(32)]
        tokens, _, _ = sample(logits.repeat(32, 1), [p] * 32, gens)
        counts += torch.bincount(torch.tensor(tokens), minlength=64)
    n = counts.sum()
    assert counts[6:].sum() == 0
    se = (want * (1 - want) / n).sqrt()
    assert ((counts[:6] / n - want).abs() < 4.5 * se).all(), (counts[:6] / n, want)


def test_top_k_one_equals_greedy(eng):
    greedy = eng.generate(["Once upon a time"], SamplingParams(max_tokens=15, temperature=0))[0]
    topk1 = eng.generate(["Once upon a time"], SamplingParams(max_tokens=15, temperature=1.5, top_k=1, seed=3))[0]
    assert greedy["token_ids"] == topk1["token_ids"]


def test_stop_strings_and_ids(eng):
    base = eng.generate(["Once upon a time"], SamplingParams(max_tokens=30, temperature=0))[0]
    assert "Lily" in base["text"]
    out = eng.generate(["Once upon a time"], SamplingParams(max_tokens=30, temperature=0, stop=["Lily"]))[0]
    assert out["finish_reason"] == "stop" and out["text"] == base["text"][: base["text"].index("Lily")]
    stop_id = base["token_ids"][5]
    out = eng.generate(["Once upon a time"], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out["token_ids"] == base["token_ids"][:6] and out["finish_reason"] == "stop"
    assert base["finish_reason"] == "length" and len(base["token_ids"]) == 30


def test_eos_from_generation_config(eng):
    assert set(eng.eos_token_ids) >= {1, 2}


def test_streamed_text_equals_full_decode(eng):
    eng.add_request("s", "Once upon a time", SamplingParams(max_tokens=50, temperature=0))
    text, ids = "", []
    while eng.has_unfinished():
        for o in eng.step():
            text += o.text_delta
            ids += o.new_token_ids
    assert text == eng.tokenizer.decode(ids, skip_special_tokens=True)


def test_detokenizer_never_splits_multibyte_chars(stories_path):
    tok = load_tokenizer(resolve_model_path(stories_path))
    text = "Lily saw é, ü, 世界 and 😀 in the park."
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.encode()) // 2  # byte fallback really splits characters here
    d = IncrementalDetokenizer(tok, [1])
    chunks = [d.add([i]) for i in ids] + [d.flush()]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_is_never_streamed(stories_path):
    tok = load_tokenizer(resolve_model_path(stories_path))
    ids = tok("the little girl named Lily", add_special_tokens=False).input_ids
    ts = TextStream(tok, [1], stop=["girl named"])
    streamed = ""
    for i in ids:
        hit = ts.add([i])
        streamed += ts.take(final=hit is not None)
        if hit:
            break
    assert hit == "girl named" and streamed == "the little "


@pytest.mark.parametrize("kw,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -3}, "top_k"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"temperature": float("nan")}, "temperature"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_params(kw, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw)


def test_bad_requests(eng):
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request(None, "", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request(None, [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context length 512"):
        eng.add_request(None, [1] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.add_request(None, [1, 9999], SamplingParams())
    eng.add_request("dup", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("dup", "hi", SamplingParams())
    assert eng.abort_request("dup")
    outs = eng.step()
    assert any(o.request_id == "dup" and o.finish_reason == "abort" for o in outs)
    assert eng.stats().used_blocks == 0


def test_abort_mid_stream_frees_blocks(eng):
    eng.add_request("a", "Once upon a time", SamplingParams(max_tokens=100, temperature=0))
    for _ in range(5):
        eng.step()
    assert eng.stats().used_blocks > 0
    eng.abort_request("a")
    eng.step()
    assert eng.stats().used_blocks == 0 and not eng.has_unfinished()


def test_stats_count_the_steps_that_ran_the_model(eng):
    before = eng.stats()
    eng.add_request("timed", "Once upon a time", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.step()  # nothing scheduled: not a step of the model
    after = eng.stats()
    assert after.num_steps - before.num_steps == 4  # the prefill's (and first token), then three decodes
    assert after.busy_s > before.busy_s


def copy_model(src: str, dst) -> str:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return str(dst)


def test_load_errors(stories_path, tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    m = copy_model(stories_path, tmp_path / "m1")
    cfg = json.loads((tmp_path / "m1" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m1" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLMEngine(EngineConfig(model=m))
    m = copy_model(stories_path, tmp_path / "m2")
    (tmp_path / "m2" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="corrupt weights"):
        LLMEngine(EngineConfig(model=m))
    m = copy_model(stories_path, tmp_path / "m3")
    (tmp_path / "m3" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing config.json"):
        LLMEngine(EngineConfig(model=m))
    m = copy_model(stories_path, tmp_path / "m4")
    (tmp_path / "m4" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt config.json"):
        LLMEngine(EngineConfig(model=m))
    with pytest.raises(ModelLoadError, match="CUDA"):
        if torch.cuda.is_available():
            raise ModelLoadError("CUDA present; skip")
        LLMEngine(EngineConfig(model=stories_path, device="cuda"))
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model=stories_path, dtype="int8")


def test_float16_runs(stories_path):
    eng = LLMEngine(EngineConfig(model=stories_path, dtype="float16"))
    out = eng.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out["token_ids"]) == 8 and eng.kv_layout.dtype == "float16"


@torch.inference_mode()
def test_bfloat16_matches_transformers_bfloat16(stories_path, random_models):
    """vLLM's rule for low precision: greedy tokens agree, or at the first divergence each side's
    token is in the other's top-5 (bf16 rounding differs between implementations)."""
    from transformers import AutoModelForCausalLM

    for path in (stories_path, random_models["qwen2"]):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
        eng = LLMEngine(EngineConfig(model=path, dtype="bfloat16"))
        g = torch.Generator().manual_seed(3)
        for n in (5, 60, 200):
            prompt = [1] + torch.randint(3, 500, (n - 1,), generator=g).tolist()
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
            ref_ids = ref.sequences[0, n:].tolist()
            ours = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0, logprobs=5, ignore_eos=True))[0]
            for pos, (a, b) in enumerate(zip(ref_ids, ours["token_ids"], strict=False)):
                if a == b:
                    continue
                ref_top = torch.topk(ref.logits[pos][0].float(), 5).indices.tolist()
                assert b in ref_top and a in ours["top_logprobs"][pos], f"{path} n={n}: diverged at {pos}"
                break


def test_first_output_carries_its_prefill_time(eng):
    eng.add_request("pt", [1, 403, 407, 261, 378], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == "pt"]
    assert outs[0].prefill_s > 0 and all(o.prefill_s == 0 for o in outs[1:])


def test_a_finishing_output_says_the_batch_its_decode_steps_had(eng):
    """The planner compares a request's TPOT with the profile's ITL at the batch it rode, so the
    engine counts it: sequences sampled together in each decode step, averaged over the steps."""
    def run(prompts: list[str], max_tokens: list[int]) -> dict[str, float]:
        ids = [eng.add_request(None, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
               for p, n in zip(prompts, max_tokens, strict=True)]
        got = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    got[out.request_id] = out.decode_batch
        return {i: got[i] for i in ids}

    alone = run(["Once upon a time"], [9])
    assert list(alone.values()) == [1.0]
    # Prefilled in one step; then three decode steps with both, five with the longer alone.
    short, long = run(["Once upon a time", "Tom had a"], [4, 9]).values()
    assert short == 2.0
    assert long == pytest.approx((3 * 2 + 5 * 1) / 8)
    assert list(run(["Mia"], [1]).values()) == [0.0]  # no decode step: nothing to say
