"""Engine output equals transformers' generate over batching, chunking, block sizes, prefix
caching and a KV export/import between two engine instances."""

from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import check_close, hf_greedy, hf_model, make_random_model

LENGTHS = [1, 2, 5, 17, 33, 100, 250, 480]
MAX_NEW = 24


@pytest.fixture(scope="module")
def story_ids(stories_path) -> list[int]:
    """A long natural story (the model's own greedy continuation) to cut prompts from."""
    eng = LLMEngine(EngineConfig(model=stories_path))
    ids = eng.tokenize("Once upon a time")
    out = eng.generate([ids], SamplingParams(max_tokens=500 - len(ids), temperature=0, ignore_eos=True))[0]
    return ids + out["token_ids"]


@pytest.fixture(scope="module")
def story_refs(stories_path, story_ids) -> dict[int, dict]:
    return {n: hf_greedy(stories_path, story_ids[:n], MAX_NEW) for n in LENGTHS}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=5, **kw)


def test_once_upon_a_time(stories_path):
    eng = LLMEngine(EngineConfig(model=stories_path))
    out = eng.generate(["Once upon a time"], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out["text"].startswith(", there was a little girl named Lily. She loved to play outside in the park")
    ids = eng.tokenize("Once upon a time")
    assert out["token_ids"] == hf_greedy(stories_path, ids, 30)["token_ids"]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_mixed_batch_matches_hf(stories_path, story_ids, story_refs, block_size, chunk):
    cfg = EngineConfig(model=stories_path, block_size=block_size, prefill_chunk_size=chunk,
                       max_num_batched_tokens=512 if chunk is None else 256)
    eng = LLMEngine(cfg)
    outs = eng.generate([story_ids[:n] for n in LENGTHS], greedy())
    for n, out in zip(LENGTHS, outs, strict=True):
        ref = story_refs[n]
        assert out["token_ids"] == ref["token_ids"], f"prompt len {n}"
        assert abs(out["logprobs"][0] - ref["logprobs"][0]) < 1e-4
    assert eng.stats().used_blocks == 0


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefix_cache_warm(stories_path, story_ids, block_size):
    eng = LLMEngine(EngineConfig(model=stories_path, block_size=block_size, max_num_batched_tokens=128))
    system = story_ids[:200]
    eng.generate([system + story_ids[300:310]], greedy())  # warm-up
    prompts = [system + story_ids[300 + 7 * i: 300 + 7 * i + 5 + i] for i in range(6)]
    outs = eng.generate(prompts, greedy())
    for p, out in zip(prompts, outs, strict=True):
        assert out["num_cached_tokens"] >= 200 - block_size
        assert out["token_ids"] == hf_greedy(stories_path, p, MAX_NEW)["token_ids"]
    st = eng.stats()
    assert st.prefix_hits > 0 and st.used_blocks == 0


def test_tiny_pool_preempts_and_recomputes(stories_path, story_ids, story_refs):
    eng = LLMEngine(EngineConfig(model=stories_path, block_size=16, num_kv_blocks=24, max_num_batched_tokens=128,
                                 enable_prefix_caching=False))
    lens = [100, 250, 17, 33]
    outs = eng.generate([story_ids[:n] for n in lens], greedy())
    for n, out in zip(lens, outs, strict=True):
        assert out["token_ids"] == story_refs[n]["token_ids"]
    assert eng.num_preemptions > 0
    assert eng.stats().used_blocks == 0


def ship(src: LLMEngine, dst: LLMEngine, rid: str, res, max_frame_bytes: int = 16 << 20):
    """Export from src and land every frame in dst's reservation (the seam the workers use)."""
    exp = src.export_kv(rid, skip_blocks=res.num_held_blocks, max_frame_bytes=max_frame_bytes)
    offset = 0
    for frame, n in zip(exp.frames, exp.blocks_per_frame, strict=True):
        dst.land_kv(res, offset, bytes(frame))
        offset += n
    assert offset == len(res.missing_block_ids)
    return exp


def transfer(src: LLMEngine, dst: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> None:
    """The prefill/decode split in miniature: copy the prefilled blocks between engines."""
    res = dst.reserve_import(rid, prompt, params)
    assert res is not None
    # Small frames: several runs per request, as over the wire.
    exp = ship(src, dst, rid, res, max_frame_bytes=3 * res.layout.block_nbytes)
    full = len(prompt) // dst.bm.block_size
    assert exp.block_hashes[:full - res.num_held_blocks] == res.block_hashes[res.num_held_blocks:full]
    src.release(rid)
    assert dst.commit_import(rid, exp.first_token, exp.first_logprob) is None


def disaggregated(pre: LLMEngine, dec: LLMEngine, prompts: list[list[int]], params: SamplingParams
                  ) -> tuple[dict[str, dict], list]:
    """Prompts ("p0", "p1", ...) prefilled on `pre`, their KV shipped by block into `dec`, decoded
    there: each one's token_ids, logprobs and top_logprobs, and the prefill's outputs."""
    for i, p in enumerate(prompts):
        pre.add_request(f"p{i}", p, params, prefill_only=True)
    got, firsts = {}, []
    while pre.has_unfinished():
        for out in pre.step():
            firsts.append(out)
            got[out.request_id] = {"token_ids": list(out.new_token_ids), "logprobs": list(out.new_logprobs),
                                   "top_logprobs": list(out.new_top_logprobs)}
    for i, p in enumerate(prompts):
        transfer(pre, dec, f"p{i}", p, params)
    while dec.has_unfinished():
        for out in dec.step():
            r = got[out.request_id]
            r["token_ids"] += out.new_token_ids
            r["logprobs"] += out.new_logprobs
            r["top_logprobs"] += out.new_top_logprobs
    return got, firsts


@pytest.mark.parametrize("block_size", [1, 16])
def test_kv_export_import(stories_path, story_ids, story_refs, block_size):
    cfg = EngineConfig(model=stories_path, block_size=block_size, max_num_batched_tokens=256)
    pre, dec = LLMEngine(cfg), LLMEngine(cfg)
    lens = [5, 33, 250, 480]
    firsts = {}
    for n in lens:
        pre.add_request(f"r{n}", story_ids[:n], greedy(), prefill_only=True)
    while pre.has_unfinished():
        for out in pre.step():
            assert out.prefilled and not out.finished
            firsts[out.request_id] = out.new_token_ids
    for n in lens:
        transfer(pre, dec, f"r{n}", story_ids[:n], greedy())
    got = {f"r{n}": list(firsts[f"r{n}"]) for n in lens}
    while dec.has_unfinished():
        for out in dec.step():
            got[out.request_id] += out.new_token_ids
    for n in lens:
        assert got[f"r{n}"] == story_refs[n]["token_ids"]
    assert pre.stats().used_blocks == 0 and dec.stats().used_blocks == 0
    assert pre.stats().cached_blocks > 0  # prefill keeps its prefix cache after shipping


def test_kv_import_skips_blocks_the_receiver_holds(stories_path, story_ids, story_refs):
    cfg = EngineConfig(model=stories_path, block_size=16)
    pre, dec = LLMEngine(cfg), LLMEngine(cfg)
    # The decode side computes KV for 100 + 23 tokens of the same story: 7 full blocks it can reuse.
    dec.generate([story_ids[:100]], greedy())
    pre.add_request("x", story_ids[:250], greedy(), prefill_only=True)
    first = [o.new_token_ids for o in pre.step()][0]
    res = dec.reserve_import("x", story_ids[:250], greedy())
    assert res.num_held_blocks == (100 + MAX_NEW - 1) // 16
    exp = ship(pre, dec, "x", res)
    assert exp.num_blocks == 16 - res.num_held_blocks and exp.first_block == res.num_held_blocks
    pre.release("x")
    dec.commit_import("x", exp.first_token, exp.first_logprob)
    toks = list(first)
    while dec.has_unfinished():
        for o in dec.step():
            toks += o.new_token_ids
    assert toks == story_refs[250]["token_ids"]


def test_export_round_trip_is_lossless(stories_path, story_ids):
    cfg = EngineConfig(model=stories_path, block_size=16)
    a, b = LLMEngine(cfg), LLMEngine(cfg)
    a.add_request("q", story_ids[:70], greedy(), prefill_only=True)
    a.step()
    res = b.reserve_import("q", story_ids[:70], greedy())
    exp = ship(a, b, "q", res)
    sent = b"".join(bytes(f) for f in exp.frames)
    landed = b"".join(bytes(f) for f in b.kv.frames(res.missing_block_ids, 1 << 30)[0])
    assert len(sent) == 5 * a.kv_layout.block_nbytes and sent == landed


def test_closed_reservation_refuses_frames(stories_path, story_ids):
    """Frames that arrive after an abort or a commit never write blocks that changed hands."""
    from engine.llm_engine import KVImportError

    cfg = EngineConfig(model=stories_path, block_size=16)
    a, b = LLMEngine(cfg), LLMEngine(cfg)
    a.add_request("q", story_ids[:40], greedy(), prefill_only=True)
    a.step()
    exp = a.export_kv("q")
    res = b.reserve_import("q", story_ids[:40], greedy())
    b.abort_request("q")
    with pytest.raises(KVImportError, match="closed"):
        b.land_kv(res, 0, bytes(exp.frames[0]))
    assert b.stats().used_blocks == 0
    res = b.reserve_import("q2", story_ids[:40], greedy())
    with pytest.raises(KVImportError, match="does not fit"):
        b.land_kv(res, 2, bytes(exp.frames[0]))  # 3 blocks from index 2 of 3 missing
    offset = 0
    for frame, n in zip(exp.frames, exp.blocks_per_frame, strict=True):
        b.land_kv(res, offset, bytes(frame))
        offset += n
    b.commit_import("q2", exp.first_token, exp.first_logprob)
    with pytest.raises(KVImportError, match="closed"):
        b.land_kv(res, 0, bytes(exp.frames[0]))


def test_awaiting_kv_counts_against_max_num_seqs(stories_path, story_ids):
    eng = LLMEngine(EngineConfig(model=stories_path, max_num_seqs=2))
    assert eng.reserve_import("a", story_ids[:20], greedy()) is not None
    assert eng.reserve_import("b", story_ids[:20], greedy()) is not None
    assert eng.reserve_import("c", story_ids[:20], greedy()) is None  # both slots held by awaiting sequences
    assert not eng.has_unfinished()  # nothing to step until KV lands
    eng.add_request("d", story_ids[:20], greedy())
    assert eng.step() == [] and eng.stats().num_waiting == 1  # a local prompt waits for a slot too
    eng.abort_request("a")
    eng.step()
    assert eng.stats().num_running == 1 and eng.stats().num_waiting == 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("block_size,chunk", [(1, 7), (16, None), (16, 64)])
def test_random_families_match_hf(random_models, arch, block_size, chunk):
    path = random_models[arch]
    g = torch.Generator().manual_seed(7)
    lens = [1, 9, 40, 130, 300]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]
    eng = LLMEngine(EngineConfig(model=path, block_size=block_size, prefill_chunk_size=chunk,
                                 max_num_batched_tokens=256))
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0, logprobs=5))
    for p, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(path, p, 16)
        check_close(ref, out, f"{arch} len {len(p)}")
        assert abs(out["logprobs"][0] - ref["logprobs"][0]) < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_random_families_prefix_and_transfer(random_models, arch):
    path = random_models[arch]
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 512, (90,), generator=g).tolist()
    prompts = [system + torch.randint(3, 512, (5 + i,), generator=g).tolist() for i in range(3)]
    cfg = EngineConfig(model=path, block_size=16)
    pre, dec = LLMEngine(cfg), LLMEngine(cfg)
    pre.generate([system + [5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))  # warm
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5)
    got, firsts = disaggregated(pre, dec, prompts, params)
    assert all(out.num_cached_tokens >= 80 for out in firsts)
    for i, p in enumerate(prompts):
        check_close(hf_greedy(path, p, 12), got[f"p{i}"], f"{arch} transfer {i}")


def test_repetition_penalty_matches_hf(stories_path):
    """vLLM's repetition penalty is transformers' (RepetitionPenaltyLogitsProcessor): a logit of a
    token in the prompt or the output divided by the penalty when positive, multiplied when not."""
    eng = LLMEngine(EngineConfig(model=stories_path))
    ids = eng.tokenize("Once upon a time")
    out = eng.generate([ids], SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3))[0]
    ref = hf_model(stories_path).generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                          repetition_penalty=1.3, pad_token_id=0)[0, len(ids):].tolist()
    assert out["token_ids"] == ref
    assert out["token_ids"] != eng.generate([ids], SamplingParams(max_tokens=40, temperature=0))[0]["token_ids"]


def test_presence_and_frequency_penalties_match_a_reference(stories_path):
    """OpenAI's penalties, against a plain loop over transformers' logits: each generated token's
    logit less presence + frequency x its count so far, then the argmax. Logprobs stay the raw
    model's (as vLLM reports them)."""
    eng = LLMEngine(EngineConfig(model=stories_path))
    # A prompt whose words the model goes on to repeat: only the outputs may count.
    ids = eng.tokenize("Once upon a time, there was a little girl named Lily. She loved to play")
    model, toks = hf_model(stories_path), []
    with torch.no_grad():
        for _ in range(40):
            logits = model(torch.tensor([ids + toks])).logits[0, -1].float()
            for t in set(toks):
                logits[t] -= 0.4 + 0.8 * toks.count(t)
            toks.append(int(torch.argmax(logits)))
    out = eng.generate([ids], SamplingParams(max_tokens=40, temperature=0, presence_penalty=0.4,
                                             frequency_penalty=0.8, logprobs=1))[0]
    assert out["token_ids"] == toks
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([ids + toks])).logits[0].float(), -1)
    assert all(abs(lp - raw[len(ids) - 1 + k, t].item()) < 1e-4 for k, (t, lp) in
               enumerate(zip(toks, out["logprobs"], strict=True)))


def test_logit_bias_forces_and_bans(stories_path):
    """OpenAI's logit_bias, added before sampling: +100 forces a token, -100 bans one; logprobs
    stay the raw model's (a forced unlikely token reports its own low logprob)."""
    from engine import InvalidRequestError

    eng = LLMEngine(EngineConfig(model=stories_path))
    ids = eng.tokenize("Once upon a time")
    greedy_ = lambda **kw: SamplingParams(max_tokens=20, temperature=0, logprobs=1, **kw)  # noqa: E731
    plain = eng.generate([ids], greedy_())[0]["token_ids"]
    banned = eng.generate([ids], greedy_(logit_bias={plain[0]: -100}))[0]["token_ids"]
    assert plain[0] not in banned and banned != plain
    forced = eng.generate([ids], greedy_(logit_bias={403: 100}))[0]
    assert forced["token_ids"] == [403] * 20 and forced["logprobs"][0] < -1.0
    sampled = eng.generate([ids], SamplingParams(max_tokens=20, temperature=1.0, seed=3, logit_bias={403: 100}))
    assert sampled[0]["token_ids"] == [403] * 20
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        eng.generate([ids], greedy_(logit_bias={10**6: 1.0}))


PENALTIES = {"presence_penalty": 0.3, "frequency_penalty": 0.7, "repetition_penalty": 1.2}


@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalized"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_resumed_request_draws_the_same_tokens(stories_path, story_ids, temperature, penalties):
    """A request resumed with the outputs the client already has (failover) continues exactly
    where the first one would have: locally, and prefilled on one engine then decoded on another
    (penalties count the resumed tokens as outputs, as the first run did)."""
    params = lambda: SamplingParams(max_tokens=40, temperature=temperature, seed=11, ignore_eos=True,  # noqa: E731
                                    **penalties)
    cfg = EngineConfig(model=stories_path, block_size=16)
    full = LLMEngine(cfg).generate([story_ids[:30]], params())[0]["token_ids"]
    sent = full[:15]
    alone = LLMEngine(cfg).generate([story_ids[:30]], params())  # sanity: deterministic
    assert alone[0]["token_ids"] == full
    eng = LLMEngine(cfg)
    eng.add_request("r", story_ids[:30], params(), resume=sent)
    rest = []
    while eng.has_unfinished():
        rest += [t for o in eng.step() for t in o.new_token_ids]
    assert sent + rest == full
    pre, dec = LLMEngine(cfg), LLMEngine(cfg)
    pre.add_request("m", story_ids[:30], params(), prefill_only=True, resume=sent)
    first = pre.step()[0].new_token_ids
    res = dec.reserve_import("m", story_ids[:30], params(), 30 + 40, resume=sent)
    exp = ship(pre, dec, "m", res)
    assert exp.first_block * 16 + sum(exp.blocks_per_frame) * 16 >= 30 + 15  # the resumed tokens' KV ships too
    dec.commit_import("m", exp.first_token, exp.first_logprob)
    toks = list(first)
    while dec.has_unfinished():
        toks += [t for o in dec.step() for t in o.new_token_ids]
    assert sent + toks == full


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 128}])
def test_scaled_rope_matches_hf(tmp_path, rope):
    """Scaled RoPE variants come from transformers (plain RoPE is read from config.json)."""

    path = make_random_model("llama", tmp_path / "m", seed=5, rope_theta=50000.0, rope_scaling=rope)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["rope_parameters"]["rope_type"] == rope["rope_type"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 300)]
    eng = LLMEngine(EngineConfig(model=path, block_size=16))
    for p, out in zip(prompts, eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=5)),
                      strict=True):
        check_close(hf_greedy(path, p, 12), out, f"{rope['rope_type']} len {len(p)}")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """qwen2 (q/k/v biases) with layers wide enough for the native panel GEMM (32K+ weights)."""
    return make_random_model("qwen2", tmp_path_factory.mktemp("wide") / "m", seed=7, hidden_size=256,
                             intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("layout", ["auto", "native", "mkl", "onednn", "both"])
@pytest.mark.parametrize("arch", ["stories", "qwen2", "qwen2-wide"])
def test_gemm_layouts_match_hf(stories_path, random_models, wide_model, arch, layout):
    """Each CPU GEMM layout, at one row (decode alone) and many (prompts, batches); qwen2 has
    biases on q/k/v, which oneDNN's packed call and the native kernel apply themselves."""
    from engine.kernels import panel_gemm
    from engine.linear import NATIVE_MIN_WEIGHT

    path = {"stories": stories_path, "qwen2-wide": wide_model}.get(arch) or random_models[arch]
    eng = LLMEngine(EngineConfig(model=path, cpu_gemm=layout))
    want = "both" if layout == "native" and panel_gemm() is None else layout
    assert eng.gemm_layout == want
    linears = [m for m in eng.model.modules() if type(m).__name__ == "Linear"]
    if want == "auto":  # measured: every layer keeps MKL's copy and only the copies it routes to
        for m in linears:
            assert m.weight_t.numel() and set(m.kernels()) == {"mkl", *m.route_kernels}
        assert len(set(eng.gemm_routes)) == len({(m.in_features, m.out_features) for m in linears})
    elif want == "native":  # panels beside the MKL copy, on the layers large enough to gain
        assert all(m.packed is None and m.weight_t.numel() for m in linears)
        assert all((m.panels is not None) == (m.weight_t.numel() >= NATIVE_MIN_WEIGHT) for m in linears)
        if arch != "qwen2":  # stories260K's layers are all too small; the wide model's all qualify
            assert all(m.panels is not None for m in linears) == (arch == "qwen2-wide")
            assert any(m.panels is not None for m in linears) == (arch == "qwen2-wide")
    else:
        assert all((m.packed is None) == (layout == "mkl") for m in linears)
        assert all((m.weight_t.numel() == 0) == (layout == "onednn") for m in linears)  # one copy, not two
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 30, 200)]
    single = eng.generate(prompts[1:2], SamplingParams(max_tokens=12, temperature=0, logprobs=5))
    batch = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=5))
    for p, out in zip(prompts[1:2] + prompts, single + batch, strict=True):
        ref = hf_greedy(path, p, 12)
        check_close(ref, out, f"{arch} {layout} len {len(p)}")
        assert abs(out["logprobs"][0] - ref["logprobs"][0]) < 1e-4


def test_onednn_row_counts_are_bucketed():
    """oneDNN compiles a kernel per GEMM shape and caches 1024: a served engine, which sees every
    row count up to its token budget, must reuse a few padded sizes or it recompiles each step."""
    from engine.linear import ONEDNN_MAX_ROWS, Linear, gemm_rows

    sizes = {gemm_rows(m) for m in range(1, 8193)}
    assert len(sizes) <= 80 and all(gemm_rows(m) >= m for m in range(1, 8193))
    assert all(gemm_rows(m) <= 1.125 * m for m in range(64, 8193))  # padding stays cheap
    assert [gemm_rows(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    torch.manual_seed(0)
    both, one = Linear(64, 96, bias=True), Linear(64, 96, bias=True)
    for lin in (both, one):
        torch.nn.init.normal_(lin.weight_t)
        torch.nn.init.normal_(lin.bias)
    one.load_state_dict(both.state_dict())
    ref = {m: torch.randn(m, 64) for m in (1, 3, 77, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 300)}
    expected = {m: torch.addmm(both.bias, x, both.weight_t) for m, x in ref.items()}
    both.pack(keep_mkl=True)
    one.pack(keep_mkl=False)
    with torch.inference_mode():
        for m, x in ref.items():
            for lin in (both, one):
                y = lin(x)
                assert y.shape == (m, 96) and y.is_contiguous()
                torch.testing.assert_close(y, expected[m], rtol=1e-5, atol=1e-4)
    assert [both.kernel_for(m) == "onednn" for m in ref] == [False, True, True, True, False, False]
    assert all(one.kernel_for(m) == "onednn" for m in ref)


def test_gemm_layout_resolution(stories_path):
    from engine.kernels import panel_gemm

    # The default: measured on this host.
    assert LLMEngine(EngineConfig(model=stories_path)).gemm_layout == "auto"
    assert LLMEngine(EngineConfig(model=stories_path, device="cpu", cpu_gemm="native")).gemm_layout == (
        "native" if panel_gemm() else "both")
    assert LLMEngine(EngineConfig(model=stories_path, dtype="bfloat16", cpu_gemm="native")).gemm_layout != "native"
    assert LLMEngine(EngineConfig(model=stories_path, cpu_gemm="mkl")).gemm_layout == "mkl"
    assert LLMEngine(EngineConfig(model=stories_path, dtype="float16", cpu_gemm="onednn")).gemm_layout == "mkl"
    # bf16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: elsewhere (AVX2) it raises, so MKL runs.
    bf16 = "both" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "mkl"
    assert LLMEngine(EngineConfig(model=stories_path, dtype="bfloat16", cpu_gemm="both")).gemm_layout == bf16
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineConfig(model=stories_path, cpu_gemm="fast")


@pytest.mark.parametrize("chunk", [7, None])
def test_prompt_logprobs_match_hf(stories_path, story_ids, chunk):
    """vLLM's prompt_logprobs: every prompt token's logprob after the ones before it, and the top
    ones there, as transformers' forward gives them; over chunks (7 tokens a step, mixed with
    other prompts), and for a prompt whose blocks are in the prefix cache (its hits would skip
    the rows that predict them, so it takes none), and not twice after a preemption's recompute."""
    prompt = story_ids[:150]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(stories_path)(torch.tensor([prompt])).logits[0].float(), -1)
    want = [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    top3 = [dict(zip(*(t.tolist() for t in reversed(ref[i].topk(3))), strict=True)) for i in range(len(prompt) - 1)]
    eng = LLMEngine(EngineConfig(model=stories_path, block_size=16, prefill_chunk_size=chunk,
                                 max_num_batched_tokens=64 if chunk else 512))
    plain = SamplingParams(max_tokens=4, temperature=0)
    asked = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3)
    eng.generate([prompt], plain)  # its blocks now in the prefix cache
    outs = eng.generate([story_ids[200:260], prompt, prompt[:1]], [plain, asked, asked])
    assert "prompt_logprobs" not in outs[0] and outs[2]["prompt_logprobs"] == []
    got = outs[1]
    assert got["num_cached_tokens"] == 0 and len(got["prompt_logprobs"]) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(got["prompt_logprobs"], want, strict=True)) < 1e-4
    for ours, theirs in zip(got["prompt_top_logprobs"], top3, strict=True):
        assert ours.keys() == theirs.keys() and max(abs(ours[t] - theirs[t]) for t in ours) < 1e-4
    assert got["token_ids"] == hf_greedy(stories_path, prompt, 4)["token_ids"]
    zero = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert zero["prompt_top_logprobs"] == [{}] * (len(prompt) - 1)
    # A pool too small for both: one is preempted and recomputed; its logprobs come once.
    tiny = LLMEngine(EngineConfig(model=stories_path, block_size=16, num_kv_blocks=14, max_num_batched_tokens=64,
                                  enable_prefix_caching=False))
    both = tiny.generate([prompt, story_ids[:100]], [SamplingParams(max_tokens=60, temperature=0,
                                                                    prompt_logprobs=1, ignore_eos=True)] * 2)
    assert tiny.num_preemptions > 0
    assert max(abs(a - b) for a, b in zip(both[0]["prompt_logprobs"], want, strict=True)) < 1e-4
    assert len(both[1]["prompt_logprobs"]) == 99
