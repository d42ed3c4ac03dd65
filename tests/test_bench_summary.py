"""`pdserve bench`'s summary on hand-built results whose figures are known exactly."""

from __future__ import annotations

import pytest

from pdserve.loadgen import Result, summarize


def test_summary_figures_are_exact():
    results = [
        # ttft 0.1 s, 5 tokens in 0.5 s: tpot (0.5 - 0.1) / 4 = 0.1 s; ITL 0.1 s each
        Result(True, prompt_len=10, output_len=5, start=0.0, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        # ttft 0.3 s, 3 tokens in 0.7 s: tpot 0.2 s; ITL 0.1 and 0.3
        Result(True, prompt_len=20, output_len=3, start=0.5, ttft=0.3, e2e=0.7, itl=[0.1, 0.3]),
        # one token only: no tpot sample
        Result(True, prompt_len=30, output_len=1, start=1.0, ttft=0.2, e2e=0.2),
        Result(False, prompt_len=40, error="UNAVAILABLE: gone"),
    ]
    s = summarize(results, duration=2.0, slo_ttft_ms=250, slo_tpot_ms=150)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(9 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((9 + 60) / 2.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # (100 + 200) / 2, the 1-token request left out
    assert s["tpot_ms"]["p50"] == pytest.approx(150.0)
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * (0.4 + 0.4) / 6)
    assert s["itl_ms"]["p99"] == pytest.approx(300.0 - 0.05 * 200, rel=1e-6)  # numpy's linear interpolation
    assert s["e2e_ms"]["mean"] == pytest.approx(1000 * 1.4 / 3)
    # Goodput: request 1 meets both (100 ms <= 250, 100 <= 150); request 2 misses TTFT (300 ms);
    # request 3 (one token, tpot 0) meets both.
    assert s["goodput_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    assert s["errors"] == ["UNAVAILABLE: gone"]


def test_tpot_slo_alone_decides_goodput():
    results = [Result(True, 1, output_len=11, ttft=5.0, e2e=6.0), Result(True, 1, output_len=11, ttft=0.1, e2e=3.1)]
    s = summarize(results, duration=1.0, slo_ttft_ms=None, slo_tpot_ms=200)
    assert s["goodput_requests"] == 1  # tpot 100 ms meets, 300 ms misses; ttft is not judged


def test_arrival_schedule_matches_vllm_bench_serve():
    """Poisson gaps scaled so the last request goes out at exactly n / rate (vllm bench serve's
    normalization), the same for every seed; constant arrivals evenly spaced; inf all at once."""
    import math

    from pdserve.loadgen import Load

    for seed in range(5):
        t = Load(request_rate=2.0).offsets(50, seed)
        assert t[-1] == pytest.approx(25.0) and all(b >= a for a, b in zip(t, t[1:], strict=False))
        assert len(set(t)) == 50  # random gaps, not a grid
    assert Load(request_rate=4.0, arrival="constant").offsets(4, 0) == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert Load(request_rate=math.inf).offsets(3, 0) == [0.0, 0.0, 0.0]
