"""cpu_gemm "auto": the routes come from timing each kernel on this host, per weight shape and row
count, and every layer ends up holding only the copies it is routed to."""

from __future__ import annotations

import time

import pytest
import torch

from engine import gemm_plan, gemm_times
from engine.gemm_plan import KERNEL_ORDER, MARGIN, pick, prompt_kernels, routes_for, tune
from engine.linear import UNBOUNDED, Linear, gemm_rows


class SlowOn(Linear):
    """A layer whose `slow` kernel pays an extra millisecond per call: the tuner must see it."""

    def __init__(self, k: int, n: int, slow: str) -> None:
        super().__init__(k, n, bias=False)
        torch.nn.init.normal_(self.weight_t)
        self.slow = slow

    def run(self, kernel: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if kernel == self.slow:
            time.sleep(0.001)
        return super().run(kernel, x, residual)


def test_pick_prefers_the_cheaper_call_within_the_margin():
    assert pick({"mkl": 1.0, "onednn": 0.5}) == "onednn"
    assert pick({"mkl": 1.0, "onednn": 1.0 / MARGIN + 1e-9}) == "mkl"  # a tie goes to MKL's copy
    assert pick({"onednn": 2.0, "native": 1.0}) == "native"


def _times(winners: dict[int, str]) -> dict[int, dict[str, float]]:
    """Times at each measured row count where `winner` is twice as fast as the rest."""
    return {p: {k: (0.5 if k == w else 1.0) * p for k in ("mkl", "onednn")} for p, w in winners.items()}


def test_prompt_rows_prefer_the_kernel_fastest_over_all_shapes():
    """At prompt sizes the routes prefer, within MARGIN, the kernel whose pass over every shape is
    fastest, and MKL no longer keeps them for being 2% behind: its cheaper call is worth the
    margin only at decode sizes."""
    times = {"a": {64: {"mkl": 1.0, "onednn": 0.9}, 256: {"mkl": 4.0, "onednn": 3.92}},
             "b": {64: {"mkl": 2.0, "onednn": 2.1}, 256: {"mkl": 8.0, "onednn": 7.85}}}
    assert prompt_kernels(times) == {256: "onednn"}  # 64 rows: decode-sized, left to the margin
    every = set(KERNEL_ORDER)
    assert routes_for(times["b"], every, 256) == ([UNBOUNDED], ["mkl"])  # within the margin
    bounds, kernels = routes_for(times["b"], every, 256, prompt_kernels(times))
    assert kernels[bounds.index(next(b for b in bounds if b >= 256))] == "onednn", (bounds, kernels)
    assert kernels[0] == "mkl" and bounds[0] >= 64  # decode sizes keep MKL within its margin
    # Beyond the margin the fastest still serves, preferred or not.
    far = {64: {"mkl": 1.0}, 256: {"mkl": 4.0, "onednn": 4.4}}
    assert routes_for(far, every, 256, {256: "onednn"})[1] == ["mkl"]


def test_routes_merge_runs_and_cover_every_row_count():
    every = set(KERNEL_ORDER)
    times = _times({1: "mkl", 4: "onednn", 16: "onednn", 64: "mkl"})
    assert routes_for(times, every, 64) == ([2, 32, UNBOUNDED], ["mkl", "onednn", "mkl"])
    assert routes_for({1: {"native": 1.0}}, every, 1) == ([UNBOUNDED], ["native"])


def test_routes_count_the_rows_onednn_pads_to():
    """oneDNN 5% faster than the native kernel at 1024 rows: it still loses the row counts it
    pads by more than that (516 rows run as 576), and keeps those it runs as they are."""
    times = {256: {"mkl": 2.0, "native": 1.0, "onednn": 1.2}, 1024: {"mkl": 8.0, "native": 4.2, "onednn": 4.0}}
    bounds, kernels = routes_for(times, set(KERNEL_ORDER), 2048)

    def kernel(rows: int) -> str:
        return next(k for b, k in zip(bounds, kernels, strict=True) if rows <= b)

    assert kernel(300) == "native"  # 256's winner
    assert [kernel(r) for r in (516, 530, 1040)] == ["native"] * 3  # padded to 576, 576, 1152
    assert [kernel(r) for r in (576, 1024, 1152, 2048)] == ["onednn"] * 4  # run as they are
    for rows in range(513, 2049):  # everywhere above 512: the cheaper of the two, padding counted
        cheaper = "onednn" if 4.0 * gemm_rows(rows) <= 4.2 * rows * MARGIN else "native"
        assert kernel(rows) == cheaper, rows


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN beside MKL")
@pytest.mark.parametrize("slow", ["mkl", "onednn"])
def test_tune_routes_away_from_a_slow_kernel(slow):
    layers = [SlowOn(256, 384, slow) for _ in range(3)]
    head = SlowOn(256, 1000, slow)
    x = torch.randn(5, 256)
    want = {id(m): x @ m.weight_t for m in (*layers, head)}
    with torch.inference_mode():
        tune([*layers, head], head, max_rows=64, logits_rows=4)
    for m in (*layers, head):
        assert slow not in m.route_kernels, (m.route_bounds, m.route_kernels)
        assert set(m.kernels()) == {"mkl", *m.route_kernels}  # unrouted copies freed
        with torch.inference_mode():
            torch.testing.assert_close(m(x), want[id(m)], rtol=1e-5, atol=1e-3)
    # The LM head is measured only up to the rows that need logits; above them its last one serves.
    assert head.route_bounds[-1] == UNBOUNDED


class FastThenSlow(Linear):
    """Every call sleeps `base` seconds, and `extra` more: below `rows` rows on every kernel but
    `kernel`, from `rows` rows on `kernel` alone (it leads at small row counts only)."""

    def __init__(self, k: int, n: int, base: float, kernel: str, rows: int, extra: float) -> None:
        super().__init__(k, n, bias=False)
        torch.nn.init.normal_(self.weight_t)
        self.base, self.kernel, self.rows, self.extra = base, kernel, rows, extra

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        slow = (kernel == self.kernel) == (x.shape[0] >= self.rows)
        time.sleep(self.base + (self.extra if slow else 0.0))
        return super().run(kernel, x)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN beside MKL")
def test_prompt_sized_rows_are_measured_even_when_whole_passes_are_long():
    """A model whose pass over all layers is long still has its prompt-sized row counts measured
    (one layer per shape): the winner at small row counts must not decide 1024-row prompts. Here
    oneDNN leads below 256 rows and trails from there on."""
    layers = [FastThenSlow(256, 384, 0.001, "onednn", 256, 0.004) for _ in range(12)]
    with torch.inference_mode():
        tune(layers, None, max_rows=1024, logits_rows=1)
    m = layers[0]
    assert m.kernel_for(16) == "onednn", (m.route_bounds, m.route_kernels)
    assert m.kernel_for(1024) != "onednn" and m.kernel_for(256) != "onednn", (m.route_bounds, m.route_kernels)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN beside MKL")
def test_a_512_row_prompt_takes_the_winner_measured_at_512_rows():
    """512 rows sit at the geometric middle of 256 and 1024: measured at those two alone, they
    took 256's winner. Here oneDNN leads up to 256 rows and trails from 512 on; a 512-token
    prompt must not run on it (nor any longer one)."""
    layers = [FastThenSlow(256, 384, 0.001, "onednn", 512, 0.004) for _ in range(2)]
    with torch.inference_mode():
        tune(layers, None, max_rows=2048, logits_rows=1)
    m = layers[0]
    assert m.kernel_for(256) == "onednn", (m.route_bounds, m.route_kernels)
    assert all(m.kernel_for(r) != "onednn" for r in (512, 1024, 2048)), (m.route_bounds, m.route_kernels)


def _tune_kept(layers, head) -> str:
    with torch.inference_mode():
        return tune([*layers, head], head, max_rows=64, logits_rows=4, keep=True)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN beside MKL")
def test_kept_times_merge_over_starts_then_decide_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))

    def made():
        return [SlowOn(256, 384, "onednn") for _ in range(3)], SlowOn(256, 1000, "onednn")
    for start in range(gemm_times.SETTLED):
        assert _tune_kept(*made()) == f"measured, merged with {start} earlier starts"
    files = list(tmp_path.glob("gemm-times-*.json"))
    assert len(files) == 1
    starts, times = gemm_times.load(files[0])
    assert starts == gemm_times.SETTLED and set(times) == {"256x384:torch.float32", "256x1000:torch.float32"}

    def no_measuring(*a, **k):
        raise AssertionError("settled times must decide without measuring")
    monkeypatch.setattr(gemm_plan, "measure", no_measuring)
    layers, head = made()
    assert _tune_kept(layers, head) == f"kept from {gemm_times.SETTLED} starts"
    x = torch.randn(5, 256)
    for m in (*layers, head):
        assert "onednn" not in m.route_kernels and set(m.kernels()) == {"mkl", *m.route_kernels}
        with torch.inference_mode():
            torch.testing.assert_close(m(x), x @ m.weight_t, rtol=1e-5, atol=1e-3)


def test_merge_keeps_the_fastest_time_seen():
    old = {"a": {1: {"mkl": 2.0, "onednn": 1.0}}}
    new = {"a": {1: {"mkl": 1.5, "onednn": 3.0}, 4: {"mkl": 1.0}}, "b": {1: {"mkl": 9.0}}}
    assert gemm_times.merge(old, new) == {"a": {1: {"mkl": 1.5, "onednn": 1.0}, 4: {"mkl": 1.0}},
                                          "b": {1: {"mkl": 9.0}}}
    assert old == {"a": {1: {"mkl": 2.0, "onednn": 1.0}}}  # inputs untouched


def test_unreadable_or_missing_times_are_measured_afresh(tmp_path):
    path = tmp_path / "gemm-times-x.json"
    assert gemm_times.load(path) == (0, {})
    path.write_text("{not json")
    assert gemm_times.load(path) == (0, {})
    gemm_times.save(path, 2, {"a": {16: {"mkl": 0.5}}})
    assert gemm_times.load(path) == (2, {"a": {16: {"mkl": 0.5}}})


def test_a_kept_kernel_this_start_cannot_hold_is_left_out():
    """Times kept from a start that built the native kernel, on a layer too small for its panels
    (or a start where the compiler is gone): the routes use what the layer can hold."""
    m = Linear(8, 8, bias=False)  # below NATIVE_MIN_WEIGHT: no panels
    torch.nn.init.normal_(m.weight_t)
    gemm_plan._route(m, {1: {"mkl": 2.0, "native": 1.0}, 16: {"mkl": 2.0, "onednn": 3.0, "native": 1.0}}, 16)
    assert m.route_kernels == ["mkl"] and m.kernels() == ("mkl",)
