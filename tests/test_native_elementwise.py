"""The native elementwise kernels (engine/csrc/elementwise.c) against the torch ops they replace in
a decoder layer: SiLU-and-multiply over the gate_up projection's halves, and the rotary embedding
of q and k heads in place (rotate_half's convention), for one row (decode) or many, with widths
that leave a tail past the last full vector."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import elementwise
from engine.model import rope_tables, rotate_half
from engine.sampler import argmax_lse

pytestmark = pytest.mark.skipif(elementwise() is None, reason="no C compiler: the kernels are not built here")


@pytest.mark.parametrize(("rows", "width"), [(1, 1408), (5, 37), (600, 512)])
def test_silu_mul_matches_torch(rows, width):
    silu_mul = elementwise().silu_mul
    torch.manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width) * 6  # well into both tails of the sigmoid
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    out = torch.empty(rows, width)
    silu_mul(gate_up.data_ptr(), gate_up.stride(0), rows, width, out.data_ptr(), width)
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("rows", "heads", "dim"), [(1, 12, 64), (7, 3, 16), (300, 6, 128), (4, 2, 20)])
def test_rotary_matches_torch(rows, heads, dim):
    rotary = elementwise().rotary
    torch.manual_seed(rows * heads + dim)
    cos_t, sin_t = rope_tables(4096, 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
    positions = torch.randint(0, 4096, (rows,))
    cos, sin = cos_t[positions], sin_t[positions]
    qkv = torch.randn(rows, (heads + 1) * dim)  # heads to rotate, then a v head that must stay as it was
    want = qkv[:, :heads * dim].view(rows, heads, dim)
    want = want * cos[:, None] + rotate_half(want) * sin[:, None]
    v = qkv[:, heads * dim:].clone()
    rotary(qkv.data_ptr(), qkv.stride(0), rows, heads, dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0))
    torch.testing.assert_close(qkv[:, :heads * dim].view(rows, heads, dim), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, heads * dim:], v)


@pytest.mark.parametrize(("rows", "cols"), [(1, 32000), (7, 37), (32, 512), (3, 5)])
def test_row_argmax_lse_matches_torch(rows, cols):
    """The sampler's argmax and log-sum-exp (the logprob of a token is its logit less it)."""
    torch.manual_seed(rows * cols)
    logits = torch.randn(rows, cols) * 8
    logits[0, cols // 2] = logits[0].max() + 0.5  # a maximum past the first vectors
    if cols > 4:
        logits[-1, 1] = logits[-1, 3] = logits[-1].max() + 1  # ties: the first one, as torch
    if cols > 17 and rows > 2:
        # A tie whose later index sits in a lower vector lane (lanes 7 and 1 at 8 or 16 floats a
        # vector): the first index, not the first lane.
        logits[1, 7] = logits[1, 17] = logits[1].max() + 1
    tokens, lse = argmax_lse(logits)
    assert tokens.tolist() == torch.argmax(logits, dim=-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)
    # A padded view (rows of stride > cols) reads only its own columns.
    wide = torch.randn(rows, cols + 9) * 8
    tokens, lse = argmax_lse(wide[:, :cols])
    assert tokens.tolist() == torch.argmax(wide[:, :cols], dim=-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(wide[:, :cols], dim=-1), rtol=1e-6, atol=1e-5)


def test_row_log_sum_exp_keeps_nan_and_far_below_the_maximum():
    """simd.h's exp at its edges: a NaN logit makes the row's log-sum-exp NaN, as torch's (a clamp
    that swallowed it would report a finite logprob); logits far below the row's maximum add
    nothing (their exp is clamped, never a denormal)."""
    logits = torch.zeros(2, 64)
    logits[0, 40] = float("nan")
    logits[1, 1:] = -1000.0
    _, lse = argmax_lse(logits)
    assert torch.isnan(lse[0]) and torch.isnan(torch.logsumexp(logits, dim=-1)[0])
    torch.testing.assert_close(lse[1], torch.tensor(0.0), atol=1e-6, rtol=0)
