"""Trace readers and synthetic loads for the simulator (pdserve/sim/traces.py), checked against
the shared traces' published statistics (../shared/traces/README.md)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pdserve.sim import bursty, diurnal, load_trace, poisson

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def _need(name: str) -> Path:
    p = TRACES / name
    if not p.exists():
        pytest.skip(f"{p} missing: the shared traces are not beside the repository")
    return p


def test_azure_trace_matches_its_readme():
    reqs = load_trace(_need("AzureLLMInferenceTrace_code.csv"))
    assert len(reqs) == 8819
    assert reqs[0].arrival_s == 0 and reqs[-1].arrival_s == pytest.approx(3435.9, abs=0.1)
    assert statistics.mean(r.prompt_len for r in reqs) == pytest.approx(2047.8, abs=0.1)
    assert statistics.mean(r.output_len for r in reqs) == pytest.approx(27.9, abs=0.1)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    # Sub-second arrival times survive (seven fractional digits in the file).
    assert reqs[1].arrival_s == pytest.approx(0.052, abs=1e-6)


def test_mooncake_trace_matches_its_readme():
    reqs = load_trace(_need("conversation_trace.jsonl"))
    assert len(reqs) == 12031
    assert reqs[-1].arrival_s == pytest.approx(3536.999)
    first = reqs[0]
    assert (first.prompt_len, first.output_len) == (6758, 500)
    assert len(first.hash_ids) == -(-first.prompt_len // 512)  # one id per 512-token block


def test_bad_files_are_refused(tmp_path):
    (tmp_path / "a.csv").write_text("time,in,out\n1,2,3\n")
    with pytest.raises(ValueError, match="not an Azure"):
        load_trace(tmp_path / "a.csv")
    (tmp_path / "b.jsonl").write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="not a Mooncake"):
        load_trace(tmp_path / "b.jsonl")


def _gaps(reqs):
    return [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]


def test_synthetic_loads_have_their_rates_and_shapes():
    p = poisson(5.0, 4000, 512, 64, seed=1, range_ratio=0.5)
    assert len(p) == 4000 and 4.7 < 4000 / p[-1].arrival_s < 5.3
    assert min(r.prompt_len for r in p) >= 256 and max(r.prompt_len for r in p) <= 768
    cv = lambda g: statistics.pstdev(g) / statistics.mean(g)  # noqa: E731
    assert 0.9 < cv(_gaps(p)) < 1.1  # Poisson
    b = bursty(5.0, 4000, 512, 64, cv=3.0, seed=1)
    assert 4.0 < 4000 / b[-1].arrival_s < 6.5 and cv(_gaps(b)) > 2.0
    d = diurnal(10.0, 3600, 512, 64, period_s=3600, amplitude=0.8, seed=1)
    first_half = sum(r.arrival_s < 1800 for r in d)  # the sine's positive half
    assert 0.85 * 36000 < len(d) < 1.15 * 36000 and first_half > 2.5 * (len(d) - first_half)
    assert poisson(5.0, 10, 512, 64, seed=3) == poisson(5.0, 10, 512, 64, seed=3)  # reproducible
