"""The native attention kernels (engine/csrc: paged decode, prompt prefill) against torch's SDPA,
and the engine without them (no C compiler): same tokens either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention import (
    DecodeGroup,
    _native_decode,
    _native_prefill,
    native_decode_available,
    native_prefill_available,
    write_kv,
)
from engine.kernels import paged_decode, prefill_attention

ROOT = Path(__file__).resolve().parent.parent


def _reference(q, k_cache, v_cache, tables, lens, window):
    """Plain attention over each sequence's gathered context."""
    outs = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        k = k_cache[tables[i]].flatten(0, 1)[:n]  # [n, KVH, D]
        v = v_cache[tables[i]].flatten(0, 1)[:n]
        lo = max(0, n - window) if window else 0
        k, v = k[lo:].transpose(0, 1), v[lo:].transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[i][:, None], k, v, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.skipif(paged_decode() is None, reason="no C compiler: the kernel is not built here")
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size", "window"),
                         [(8, 4, 64, 16, None), (8, 2, 32, 16, 37), (4, 4, 8, 8, None), (12, 3, 128, 32, 5),
                          # Head sizes of 1-6 vectors (AVX-512 or AVX2), blocks shorter and longer
                          # than a vector of tokens, eight queries per KV head, none shared.
                          (6, 6, 48, 64, None), (16, 2, 16, 8, None), (4, 1, 80, 16, 20), (2, 2, 96, 4, None)])
def test_kernel_matches_sdpa(heads, kv_heads, dim, block_size, window):
    g = torch.Generator().manual_seed(heads * dim + block_size)
    layers, num_blocks = 3, 64
    # The pool's own layout: per-layer K and V are strided views of one block-major buffer.
    pool = torch.randn(num_blocks, layers, 2, block_size, kv_heads, dim, generator=g)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    lens = torch.tensor([1, block_size, block_size + 1, 5 * block_size - 3, 3 * block_size + 7, 2], dtype=torch.long)
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=g)
    # All six, then fewer sequences than threads: the kernel splits each one over the threads, by
    # its context (partial softmaxes merged; parts left empty where a sequence has fewer blocks
    # than parts) or, on the scalar path, by its KV heads.
    threads = torch.get_num_threads()
    try:
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            for rows in (list(range(len(lens))), [3], [3, 4], [0], [2], [4, 5]):
                sub = torch.tensor(rows)
                group = DecodeGroup(rows=torch.arange(len(rows)), block_tables=tables[sub], context_lens=lens[sub],
                                    max_len=int(lens[sub].max()))
                got = _native_decode(q[sub], k_cache, v_cache, group, window)
                want = _reference(q[sub], k_cache, v_cache, tables[sub], lens[sub], window)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(paged_decode() is None, reason="no C compiler: the kernel is not built here")
def test_decode_kernel_reads_q_from_the_projection():
    """q as the model hands it over at a decode step: a view into the fused QKV projection, rows
    (heads + 2 x kv_heads) x dim apart, read in place (no copy): the same output as from a
    contiguous copy, bit for bit."""
    heads, kv_heads, dim, block_size = 8, 4, 64, 16
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(40, 2, 2, block_size, kv_heads, dim, generator=g)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    lens = torch.tensor([3, 17, 40, 64, 9], dtype=torch.long)
    tables = torch.stack([torch.randperm(40, generator=g)[:4] for _ in lens])
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, :heads * dim].view(len(lens), heads, dim)
    assert not q.is_contiguous()
    group = DecodeGroup(rows=torch.arange(len(lens)), block_tables=tables, context_lens=lens, max_len=64)
    got = _native_decode(q, k_cache, v_cache, group, None)
    torch.testing.assert_close(got, _native_decode(q.contiguous(), k_cache, v_cache, group, None), rtol=0, atol=0)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, lens, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 700])
def test_kv_writes_land_in_their_slots(tokens):
    """The step's K and V rows (views into the QKV projection) go to their (block, offset) slots
    of the per-layer pool views, natively where it can, as index_put would put them; nothing else
    in the pool changes."""
    heads, kv_heads, dim, block_size, num_blocks = 8, 4, 16, 16, 64
    g = torch.Generator().manual_seed(tokens)
    pool = torch.randn(num_blocks, 3, 2, block_size, kv_heads, dim, generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    blocks, offsets = slots // block_size, slots % block_size
    want = pool.clone()
    want[:, 1, 0][blocks, offsets] = k
    want[:, 1, 1][blocks, offsets] = v
    write_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], blocks, offsets)
    assert torch.equal(pool, want)


@pytest.mark.skipif(prefill_attention() is None, reason="no C compiler: the kernel is not built here")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 4, 64), (4, 4, 16), (6, 2, 128)])
@pytest.mark.parametrize(("n", "prefix"), [(1, 0), (47, 0), (48, 0), (130, 0), (700, 0), (1, 9), (64, 64),
                                           (37, 300), (200, 1000)])
def test_prefill_kernel_matches_sdpa(heads, kv_heads, dim, n, prefix):
    """Sizes around the kernel's 48-query and 64-key tiles, with and without cached context."""
    if dim % prefill_attention().vector_width:
        pytest.skip(f"head size {dim} is not a multiple of this build's vector width")
    g = torch.Generator().manual_seed(n * 7 + prefix + dim)
    q = torch.randn(n, heads, dim, generator=g)
    k, v = torch.randn(prefix + n, kv_heads, dim, generator=g), torch.randn(prefix + n, kv_heads, dim, generator=g)
    # Query i sits at position prefix + i and sees keys 0 .. prefix + i.
    mask = torch.arange(prefix + n)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                          enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(_native_prefill(q, k, v, prefix), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(prefill_attention() is None, reason="no C compiler: the kernel is not built here")
@pytest.mark.parametrize(("n", "prefix"), [(5, 0), (100, 0), (53, 77)])
def test_prefill_kernel_reads_projection_views(n, prefix):
    """q, k and v as the model hands them over: views into one fused QKV projection, rows
    (heads + 2 x kv_heads) x dim apart, read in place; the result lands in the `out` given."""
    heads, kv_heads, dim = 8, 4, 64
    g = torch.Generator().manual_seed(n + prefix)
    qkv = torch.randn(prefix + n, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[prefix:, :heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(prefix + n, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(prefix + n, kv_heads, dim)
    want = _native_prefill(q.contiguous(), k.contiguous(), v.contiguous(), prefix)
    out = torch.full((n + 2, heads, dim), 7.0)
    got = _native_prefill(q, k, v, prefix, out[1:n + 1])
    assert got.data_ptr() == out[1].data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (out[0] == 7).all() and (out[-1] == 7).all()  # only its own rows written
    with pytest.raises(ValueError):  # a wrong shape would have the kernel write past its end
        _native_prefill(q, k, v, prefix, out[:n + 1])


def test_availability_follows_dtype_and_limits():
    if paged_decode() is None:
        assert not native_decode_available(torch.float32, torch.device("cpu"), 8, 4, 64, 16)
        return
    assert native_decode_available(torch.float32, torch.device("cpu"), 8, 4, 64, 16)
    assert not native_decode_available(torch.bfloat16, torch.device("cpu"), 8, 4, 64, 16)
    assert not native_decode_available(torch.float32, torch.device("cpu"), 8, 4, 4096, 16)
    if prefill_attention() is not None:
        assert native_prefill_available(torch.float32, torch.device("cpu"), 64)
        assert not native_prefill_available(torch.float32, torch.device("cpu"), prefill_attention().vector_width + 1)
        assert not native_prefill_available(torch.bfloat16, torch.device("cpu"), 64)


_GENERATE = """
import json, sys
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import paged_decode
eng = LLMEngine(EngineConfig(model=sys.argv[1], num_threads=1))
prompts = ["Once upon a time", "Lily and Ben went to the park to play with"]
outs = eng.generate(prompts, SamplingParams(max_tokens=80, temperature=0))
print(json.dumps({"native": eng.runner.native_decode, "kernel": paged_decode() is not None,
                  "tokens": [o["token_ids"] for o in outs]}))
"""


def _generate(stories_path: str, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", _GENERATE, stories_path], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_engine_without_a_compiler_falls_back_to_the_same_tokens(stories_path, tmp_path):
    base = {**os.environ, "PDSERVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    without = _generate(stories_path, {**base, "CC": str(tmp_path / "no-such-compiler")})
    assert without == {**without, "native": False, "kernel": False}
    if paged_decode() is None:
        pytest.skip("no C compiler here: only the fallback path ran")
    with_kernel = _generate(stories_path, base)
    assert with_kernel["native"] and with_kernel["kernel"]
    assert with_kernel["tokens"] == without["tokens"]
    assert any((tmp_path / "kernels").glob("paged_attention-*.so"))
