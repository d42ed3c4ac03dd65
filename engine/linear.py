"""The linear layer and the CPU GEMMs behind it: y = x W^T + b from up to three copies of W, each
row count routed to one kernel (EngineConfig.cpu_gemm; engine/gemm_tuner.py measures the routes
for "auto"):
- "mkl": `weight_t`, W transposed ([in, out]), through torch's matmul (MKL on the CPU); as fast as
  nn.Linear's layout for long prompts and up to ~1.7x faster at decode batches;
- "onednn": `packed`, W reordered for oneDNN, the layout vLLM's CPU backend runs;
- "native": `panels`, W in column panels for the native GEMM (engine/csrc/panel_gemm.c).

Which kernel is fastest depends on the host, the layer's shape and the row count. Measured on the
50M benchmark model's layers, 2 threads:
- AMD EPYC (AVX2): the native kernel ran 1 row 1.6-2.1x faster than MKL or oneDNN, 8 rows 1.5x and
  32 rows 1.3x faster than oneDNN, and whole prompts 2-19% faster than MKL; oneDNN beat MKL
  1.1-1.7x at 2-128 rows, MKL was 3-11% faster from 200 rows on.
- Intel Xeon (AVX-512): with one AVX-512 register per row (AVX2's panel shape) the native kernel
  was 1.1-1.8x slower than MKL at every row count; with two (32-float panels, 12-row tiles) it
  ran the body layers at 0.97-1.56x the better library's rate at 8-32 rows and at 70-85% of it
  on 2048-row prompts. The 32000-word LM head (64 MiB, streamed from memory) needed the next
  panel prefetched as well: then 1.4-1.5x oneDNN's rate at 8 rows and 1.0-1.16x at 32.
"""

from __future__ import annotations

from bisect import bisect_left

import torch
from torch import nn

from engine.huge_pages import into_huge_pages
from engine.kernels import panel_gemm

KERNELS = ("mkl", "onednn", "native")
UNBOUNDED = 1 << 62
# With both MKL and oneDNN copies and no measurement ("both"), oneDNN runs from 2 to this many
# rows and MKL the rest (the AMD EPYC measurements above; at one row they tie).
ONEDNN_MAX_ROWS = 128
# Without a measurement ("native"), the native panel GEMM serves up to this many rows (an engine
# step's tokens: MKL only past it), for weights of at least NATIVE_MIN_WEIGHT elements. Below ~32K
# elements (the 64-wide layers of stories260K) a call is mostly overhead, and MKL's is the
# smallest: ~6 us, against ~11 us through ctypes and ~65 us for oneDNN.
NATIVE_MAX_ROWS = 8192
NATIVE_MIN_WEIGHT = 32768


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        # Rows up to route_bounds[i] (and above the previous bound) run on route_kernels[i].
        self.route_bounds: list[int] = [UNBOUNDED]
        self.route_kernels: list[str] = ["mkl"]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] if self.packed is not None else self.weight_t.shape[0]

    @property
    def out_features(self) -> int:
        return self.packed.shape[0] if self.packed is not None else self.weight_t.shape[1]

    def kernels(self) -> tuple[str, ...]:
        """The kernels whose copy of W this layer holds."""
        have = {"mkl": self.weight_t.numel() > 0, "onednn": self.packed is not None, "native": self.panels is not None}
        return tuple(k for k in KERNELS if have[k])

    def kernel_for(self, rows: int) -> str:
        return self.route_kernels[bisect_left(self.route_bounds, rows)]

    def route(self, bounds: list[int], kernels: list[str]) -> None:
        """Send rows up to bounds[i] to kernels[i]; the last bound must cover every row count."""
        if len(bounds) != len(kernels) or not bounds or bounds[-1] < UNBOUNDED or bounds != sorted(bounds):
            raise ValueError(f"routes {bounds} / {kernels}: ascending bounds ending at UNBOUNDED, one per kernel")
        missing = set(kernels) - set(self.kernels())
        if missing:
            raise ValueError(f"no copy of the weight for {sorted(missing)}; this layer holds {self.kernels()}")
        self.route_bounds, self.route_kernels = list(bounds), list(kernels)

    def pack(self, keep_mkl: bool) -> None:
        """Add the oneDNN copy, routed from 2 to ONEDNN_MAX_ROWS rows; without `keep_mkl` it
        replaces the MKL one (half the memory) and serves every row count."""
        w = self.weight_t.detach().t().contiguous()
        # The row-count hint only tunes the blocking; the packed weight serves any number of rows.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        if keep_mkl:
            self.route([1, ONEDNN_MAX_ROWS, UNBOUNDED], ["mkl", "onednn", "mkl"])
        else:
            self.route([UNBOUNDED], ["onednn"])
            self.weight_t = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)

    def pack_panels(self) -> bool:
        """Add the native kernel's copy beside the MKL one, routed up to NATIVE_MAX_ROWS rows,
        where the kernel is built and the weight is large enough to gain from it; whether it did."""
        w = self.weight_t.detach()
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.numel() < NATIVE_MIN_WEIGHT:
            return False
        fn = panel_gemm()
        if fn is None:
            return False
        k, n, nb = w.shape[0], w.shape[1], fn.panel_width
        padded = w.new_zeros(k, -(-n // nb) * nb)
        padded[:, :n] = w
        # Panel j: columns j*nb..(j+1)*nb of W^T, row after row, in one contiguous run.
        self.panels = padded.view(k, -1, nb).transpose(0, 1).contiguous()
        self.route([NATIVE_MAX_ROWS, UNBOUNDED], ["native", "mkl"])
        return True

    def drop_unrouted(self) -> None:
        """Free the oneDNN and native copies no row count is routed to (the MKL one stays: it is
        the parameter the checkpoint loaded into)."""
        if "onednn" not in self.route_kernels:
            self.packed = None
        if "native" not in self.route_kernels:
            self.panels = None

    def run(self, kernel: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b (+ residual) on one kernel, whatever the routes say (the tuner times each this
        way). The native kernel adds the residual as it stores its tiles; the others add it after,
        which rounds the same: (x W^T + b) + residual."""
        m = x.shape[0]
        if kernel == "native":
            if x.stride(-1) != 1:
                x = x.contiguous()
            n = self.weight_t.shape[1]  # the panels sit beside the MKL copy, never instead of it
            y = torch.empty(m, n, dtype=x.dtype, device=x.device)
            bias = None if self.bias is None else self.bias.data_ptr()
            res, ldr = None, 0
            if residual is not None:
                if residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != y.dtype:
                    raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} for a {m} x {n} output")
                res, ldr = residual.data_ptr(), residual.stride(0)
            panel_gemm()(x.data_ptr(), x.stride(0), m, x.shape[1], self.panels.data_ptr(), n, bias, res, ldr,
                         y.data_ptr(), n)
            return y
        y = self._library(kernel, x)
        return y if residual is None else residual + y

    def _library(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if kernel == "onednn":
            padded = gemm_rows(m)
            if padded != m:  # see gemm_rows: a few shapes, each compiled once
                x = torch.cat([x, x.new_zeros(padded - m, x.shape[1])])
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:m]
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(self.kernel_for(x.shape[0]), x, residual)


def gemm_rows(m: int) -> int:
    """The row count a oneDNN GEMM of m rows runs at. oneDNN compiles a kernel per shape and keeps
    1024 in its cache; a serving engine sees every row count from 1 to its token budget, and
    compiling one costs ~1.7 ms per layer (50 ms per step of the 50M model), which made a served
    worker slower than MKL under load. Rounding up to 8 sizes per doubling (powers of two up to 8,
    then steps of an eighth of the power of two below, at least 8: under 1/8 padding from 64 rows
    on) keeps every shape of a token budget up to 8192 in the cache: 67 sizes x 5 weight shapes."""
    if m <= 8:
        return 1 << (m - 1).bit_length()
    step = max(8, 1 << ((m - 1).bit_length() - 4))
    return -(-m // step) * step


def weights_into_huge_pages(net: nn.Module) -> int:
    """Move the CPU linear layers' own copies of their weights (the MKL and native ones; oneDNN's
    is opaque to us) into memory advised into huge pages (engine/huge_pages.py): decode steps
    stream every weight, a TLB miss every 4 KiB of the heap. Returns bytes moved."""
    items = []
    for m in net.modules():
        if not isinstance(m, Linear) or m.weight_t.device.type != "cpu":
            continue
        if m.weight_t.numel():
            items.append((m.weight_t.data, lambda t, m=m: setattr(m.weight_t, "data", t)))
        if m.panels is not None:
            items.append((m.panels, lambda t, m=m: setattr(m, "panels", t)))
    return into_huge_pages(items) if items else 0
