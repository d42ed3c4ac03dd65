"""The native RMSNorm (engine/csrc/rms_norm.c) behind `RMSNorm` for fp32 rows: the same values as
torch's, one row (decode) or many (a prompt, split across threads), strided rows; 3-D views
(per-head q/k norms) keep torch's op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import rms_norm
from engine.model import RMSNorm

pytestmark = pytest.mark.skipif(rms_norm() is None, reason="no C compiler: the kernel is not built here")


@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (3, 512), (300, 512), (7, 100)])
def test_native_rms_norm_matches_torch(rows, dim):
    torch.manual_seed(rows + dim)
    norm = RMSNorm(dim, 1e-5)
    torch.nn.init.normal_(norm.weight)
    for x in (torch.randn(rows, dim) * 3, torch.randn(rows, dim + 5)[:, 2:2 + dim]):
        with torch.inference_mode():
            got = norm(x)
        want = F.rms_norm(x, (dim,), norm.weight, 1e-5)
        assert got.shape == (rows, dim) and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_per_head_views_use_torch(monkeypatch):
    import engine.model as model

    calls = []
    monkeypatch.setattr(model, "native_rms_norm", lambda: calls.append(1) or rms_norm())
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(4, 3 * 8 * 16)[:, :8 * 16].view(4, 8, 16)  # q heads inside a fused qkv row
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.weight, 1e-6))
    assert not calls
    norm(torch.randn(4, 16))
    assert calls
