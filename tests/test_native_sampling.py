"""Random sampling's rule (engine/sampler.py draw_rows: temperature, top-k, top-p, then the token at
u of the kept tokens' cumulative distribution) against a float64 reference built by sorting, for
the native kernel (engine/csrc/sampling.c, which selects instead of sorting) and torch's ops. Each
kept token is asked for at the middle of its own interval of the distribution, so a token kept or
dropped wrongly, or a probability off, moves some answer to another token."""

from __future__ import annotations

import pytest
import torch

from engine import sampler
from engine.kernels import sample_rows

native = pytest.mark.skipif(sample_rows() is None, reason="no C compiler: the kernels are not built here")


def reference(row: torch.Tensor, temp: float, top_k: int, top_p: float) -> torch.Tensor:
    """The kept tokens' probabilities (float64, 0 for dropped), by the sort rule: after top-k,
    keep a token while the mass before it, in descending order, is below top_p."""
    y = (row / temp).double()
    keep = torch.isfinite(y)
    if 0 < top_k < y.numel():
        keep &= y >= torch.topk(y, top_k).values[-1]
    w = torch.where(keep, (y - y[keep].max()).exp(), torch.zeros_like(y))
    if top_p < 1.0:
        order = torch.argsort(torch.where(keep, y, -torch.inf), descending=True, stable=True)
        q = w[order] / w.sum()
        dropped = order[q.cumsum(0) - q >= top_p]
        w[dropped] = 0.0
    return w / w.sum()


def p_between(row: torch.Tensor, temp: float, top_k: int, keep: int) -> float:
    """A top_p that keeps exactly `keep` tokens with a wide margin: half way into the last one's mass."""
    probs = reference(row, temp, top_k, 1.0).sort(descending=True).values
    cum = probs.cumsum(0)
    return float(cum[keep - 1] - probs[keep - 1] / 2)


def check(draw, row: torch.Tensor, temp: float, top_k: int, top_p: float) -> int:
    """Ask `draw` (draw_rows) for every kept token of mass >= 1e-5 at the middle of its interval,
    all in one call (rows of a batch, every other one), and compare. Returns how many were asked."""
    probs = reference(row, temp, top_k, top_p)
    before = probs.cumsum(0) - probs
    want = [int(i) for i in torch.nonzero(probs >= 1e-5).flatten()]
    u = torch.tensor([float(before[i] + probs[i] / 2) for i in want], dtype=torch.float64)
    batch = row.repeat(2 * len(want), 1)
    rows = list(range(1, 2 * len(want), 2))
    got = draw(batch, rows, [temp] * len(want), [top_k] * len(want), [top_p] * len(want), u).tolist()
    assert got == want, [(w, g) for w, g in zip(want, got, strict=True) if w != g][:5]
    # The very top of the distribution: a kept token, at or past the last one asked for (the tokens
    # past that are too light to tell apart from each other there).
    top = int(draw(row[None], [0], [temp], [top_k], [top_p], torch.tensor([1 - 1e-12], dtype=torch.float64)))
    assert probs[top] > 0 and top >= want[-1], top
    return len(want)


CASES = [  # temperature, top_k, how many tokens top_p keeps (None: top_p 1)
    (1.0, 0, None), (0.7, 0, None), (1.3, 50, None), (1.0, 0, 3), (0.8, 0, 40), (1.0, 50, 20), (1.0, 7, 7)]


@native
@pytest.mark.parametrize(("vocab", "scale"), [(512, 1.0), (512, 6.0), (32003, 1.0), (32003, 8.0)])
@pytest.mark.parametrize(("temp", "top_k", "keep"), CASES)
def test_native_draws_match_the_sort_rule(vocab, scale, temp, top_k, keep):
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab + int(scale))) * scale
    row[5] = -torch.inf  # a token no filter or temperature may bring back
    top_p = 1.0 if keep is None else p_between(row, temp, top_k, keep)
    assert check(sampler.draw_rows, row, temp, top_k, top_p) > 0


@pytest.mark.parametrize(("temp", "top_k", "keep"), CASES)
def test_torch_draws_match_the_sort_rule(monkeypatch, temp, top_k, keep):
    monkeypatch.setattr(sampler, "sample_rows", lambda: None)  # as where no compiler is found
    row = torch.randn(512, generator=torch.Generator().manual_seed(7)) * 3
    top_p = 1.0 if keep is None else p_between(row, temp, top_k, keep)
    assert check(sampler.draw_rows, row, temp, top_k, top_p) > 0


@native
def test_a_tie_at_the_cut_keeps_every_tied_token():
    # top_k 2 cuts inside three equal logits: all three stay (a sort kept whichever came first),
    # each a third of the mass; the 1 and 0 go.
    row = torch.tensor([3.0, 3.0, 1.0, 3.0, 0.0])
    u = torch.tensor([1 / 6, 1 / 2, 5 / 6], dtype=torch.float64)
    got = sampler.draw_rows(row.repeat(3, 1), [0, 1, 2], [1.0] * 3, [2] * 3, [1.0] * 3, u)
    assert got.tolist() == [0, 1, 3]


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_a_temperature_that_overflows_a_logit_draws_the_largest(monkeypatch, kernel):
    if kernel == "torch":
        monkeypatch.setattr(sampler, "sample_rows", lambda: None)
    elif sample_rows() is None:
        pytest.skip("no C compiler: the kernels are not built here")
    row = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0])  # 3 / 1e-39 is past float32's range
    u = torch.tensor([0.2, 0.9], dtype=torch.float64)
    assert sampler.draw_rows(row.repeat(2, 1), [0, 1], [1e-39] * 2, [0, 2], [1.0, 0.5], u).tolist() == [1, 1]


@native
def test_a_row_without_finite_logits_draws_token_zero():
    row = torch.full((64,), -torch.inf)
    got = sampler.draw_rows(row[None], [0], [1.0], [0], [0.9], torch.tensor([0.5], dtype=torch.float64))
    assert got.tolist() == [0]
