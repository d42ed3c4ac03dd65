"""The native panel GEMM (engine/csrc/panel_gemm.c) behind `Linear` for decode batches and
prompts: the same product as MKL for every row count it serves (within and across its row
blocks), odd widths, biases and strided rows; only layers large enough to gain from it get the
panel copy."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import panel_gemm
from engine.linear import NATIVE_MAX_ROWS, NATIVE_MIN_WEIGHT, Linear

pytestmark = pytest.mark.skipif(panel_gemm() is None, reason="no C compiler: the kernel is not built here")


def _linear(k: int, n: int, bias: bool, seed: int) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    torch.nn.init.normal_(lin.weight_t)
    if bias:
        torch.nn.init.normal_(lin.bias)
    return lin


@pytest.mark.parametrize(("k", "n", "bias"), [(512, 1024, False), (256, 1000, True), (600, 61, True), (97, 512, False)])
def test_panel_gemm_matches_mkl(k, n, bias):
    lin = _linear(k, n, bias, seed=k + n)
    assert lin.pack_panels() and lin.kernel_for(1) == lin.kernel_for(NATIVE_MAX_ROWS) == "native"
    assert lin.kernel_for(NATIVE_MAX_ROWS + 1) == "mkl"
    with torch.inference_mode():
        # 1-13: every tile height (6 rows a tile with AVX2, 12 with AVX-512) and one past; 25, 32, 35:
        # three tiles, the last a short one (a batch-32 decode step); 95-97,
        # 193: either side of the kernel's 96-row blocks; 300: several blocks and a short one
        for m in (*range(1, 14), 17, 25, 32, 35, 95, 96, 97, 193, 300, NATIVE_MAX_ROWS):
            for x in (torch.randn(m, k), torch.randn(m, k + 9)[:, 4:4 + k]):  # dense rows, then strided
                want = torch.addmm(lin.bias, x, lin.weight_t) if bias else x @ lin.weight_t
                got = lin(x)
                assert got.shape == (m, n) and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_rows_beyond_the_limit_and_small_layers_use_mkl():
    lin = _linear(256, 512, True, seed=1)
    lin.pack_panels()
    x = torch.randn(NATIVE_MAX_ROWS + 1, 256)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), torch.addmm(lin.bias, x, lin.weight_t))
    small = _linear(64, NATIVE_MIN_WEIGHT // 64 - 1, False, seed=2)  # one element short
    assert not small.pack_panels() and small.panels is None and small.kernel_for(1) == "mkl"


@pytest.mark.parametrize("m", [1, 13, 32, 97])
def test_residual_added_in_the_kernel_rounds_as_the_separate_add(m):
    """A decoder layer's o_proj and down_proj take the residual into the GEMM's stores: the same
    bits as adding it after, (x W + b) + residual, on every kernel."""
    lin = _linear(512, 384, True, seed=m)
    lin.pack_panels()
    x, residual = torch.randn(m, 512), torch.randn(m, 384)
    with torch.inference_mode():
        for kernel in ("native", "mkl"):
            got = lin.run(kernel, x, residual)
            assert torch.equal(got, residual + lin.run(kernel, x)), kernel
        with pytest.raises(ValueError):
            lin.run("native", x, residual[:, :100])
