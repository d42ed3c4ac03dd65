"""The native decode step (engine/decode_step.py): one C call for a decode step's layers, the
same kernels in the same order as the layers run from Python, so the same bits."""

from __future__ import annotations

import pytest
import torch
from conftest import check_close, hf_greedy, make_random_model
from test_engine_generation import disaggregated

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import decode_step, panel_gemm

pytestmark = pytest.mark.skipif(decode_step() is None or panel_gemm() is None,
                                reason="no C compiler: the native kernels are not built here")


def _wide(tmp_path, arch: str, **extra) -> str:
    # Layers of 32K+ weights, so every one has its panels and the step can run natively.
    return make_random_model(arch, tmp_path / arch, seed=11, hidden_size=256, intermediate_size=384,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **extra)


@pytest.mark.parametrize(("arch", "extra"), [("llama", {}), ("mistral", {"sliding_window": 48}),
                                             ("qwen2", {})])  # qwen2: q/k/v biases
def test_native_step_gives_the_layers_bits(tmp_path, arch, extra):
    path = _wide(tmp_path, arch, **extra)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 40, 130)]
    params = [SamplingParams(max_tokens=24, temperature=0, logprobs=3),
              SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=5, logprobs=3)]
    runs = {}
    for eager in (False, True):
        eng = LLMEngine(EngineConfig(model=path, cpu_gemm="native", enforce_eager=eager))
        runs[eager] = [eng.generate(prompts[:1], p) + eng.generate(prompts, p) for p in params]
        # Decode steps ran natively unless told not to (prompt steps never do).
        assert (eng.model.native_steps > 0) == (not eager)
    for native, eager in zip(runs[False], runs[True], strict=True):
        for a, b in zip(native, eager, strict=True):
            assert a["token_ids"] == b["token_ids"]
            assert a["logprobs"] == b["logprobs"] and a["top_logprobs"] == b["top_logprobs"]
    for p, out in zip(prompts[:1] + prompts, runs[False][0], strict=True):  # and transformers' greedy
        check_close(hf_greedy(path, p, 24), out, f"{arch} native step, len {len(p)}")


def test_imported_kv_decodes_natively_as_in_one_engine(tmp_path):
    """The decode pool's case: prompts prefilled on one engine, their KV shipped by block into
    another, which decodes them with the native step; the tokens and logprobs of one eager engine."""
    path = _wide(tmp_path, "llama")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (17, 64, 150)]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2)
    want = LLMEngine(EngineConfig(model=path, cpu_gemm="native", enforce_eager=True)).generate(prompts, params)
    pre, dec = (LLMEngine(EngineConfig(model=path, cpu_gemm="native", block_size=16)) for _ in range(2))
    got, _ = disaggregated(pre, dec, prompts, params)
    assert dec.model.native_steps > 0
    for i, w in enumerate(want):
        assert got[f"p{i}"]["token_ids"] == w["token_ids"]
        assert got[f"p{i}"]["logprobs"] == w["logprobs"]
