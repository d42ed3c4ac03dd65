"""cpu_gemm "auto": the routes come from timing each kernel on this host, per weight shape and row
count, and every layer ends up holding only the copies it is routed to."""

from __future__ import annotations

import time

import pytest
import torch

from engine.gemm_plan import MARGIN, pick, routes_from, tune
from engine.linear import UNBOUNDED, Linear


class SlowOn(Linear):
    """A layer whose `slow` kernel pays an extra millisecond per call: the tuner must see it."""

    def __init__(self, k: int, n: int, slow: str) -> None:
        super().__init__(k, n, bias=False)
        torch.nn.init.normal_(self.weight_t)
        self.slow = slow

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == self.slow:
            time.sleep(0.001)
        return super().run(kernel, x)


def test_pick_prefers_the_cheaper_call_within_the_margin():
    assert pick({"mkl": 1.0, "onednn": 0.5}) == "onednn"
    assert pick({"mkl": 1.0, "onednn": 1.0 / MARGIN + 1e-9}) == "mkl"  # a tie goes to MKL's copy
    assert pick({"onednn": 2.0, "native": 1.0}) == "native"


def test_routes_merge_runs_and_cover_every_row_count():
    assert routes_from([1, 4, 16, 64], ["mkl", "onednn", "onednn", "mkl"]) == ([2, 32, UNBOUNDED],
                                                                               ["mkl", "onednn", "mkl"])
    assert routes_from([1], ["native"]) == ([UNBOUNDED], ["native"])


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
