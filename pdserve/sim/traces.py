"""Request traces for the simulator and the planner: the two published formats, and synthetic
loads (Poisson, bursty, diurnal).

- Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps as
  `YYYY-MM-DD HH:MM:SS.fffffff` (seven fractional digits), optionally with a UTC offset.
- Mooncake JSON lines: `timestamp` (ms from the start), `input_length`, `output_length`,
  `hash_ids` (one id per 512-token prompt block; equal ids mark a shared prefix).

Arrivals are seconds from the trace's first request, in order.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # prefix blocks (Mooncake), for prefix-cache hits


def _azure_time(text: str) -> datetime:
    """A TIMESTAMP as naive UTC. Python 3.11 parses the 2023 traces' seven fractional digits
    (truncated to six) and a UTC offset; a trace written with an offset (`+00:00`) may drop the
    fraction where it is zero, and mixing aware and naive times would make the first arrival
    unfindable."""
    t = datetime.fromisoformat(text.strip())
    return t.astimezone(UTC).replace(tzinfo=None) if t.tzinfo else t


def _load_azure(path: Path) -> list[TraceRequest]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(rows[0] if rows else {})
    if missing:
        raise ValueError(f"{path}: not an Azure LLM inference trace (missing columns {sorted(missing)})")
    times = [_azure_time(r["TIMESTAMP"]) for r in rows]
    t0 = min(times)
    return [TraceRequest((t - t0).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for t, r in zip(times, rows, strict=True)]


def _load_mooncake(path: Path) -> list[TraceRequest]:
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out.append(TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]),
                                        tuple(r.get("hash_ids", ()))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({e})") from e
    t0 = min((r.arrival_s for r in out), default=0.0)
    return [TraceRequest(r.arrival_s - t0, r.prompt_len, r.output_len, r.hash_ids) for r in out]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Either published format, told apart by the first line; sorted by arrival."""
    p = Path(path)
    with p.open() as f:
        first = f.readline().strip()
    reqs = _load_mooncake(p) if first.startswith("{") else _load_azure(p)
    if not reqs:
        raise ValueError(f"{p}: the trace has no requests")
    return sorted(reqs, key=lambda r: r.arrival_s)


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def poisson(rate: float, n: int, prompt_len: int, output_len: int, seed: int = 0,
            range_ratio: float = 0.0) -> list[TraceRequest]:
    """n requests at `rate` per second, exponential gaps; lengths uniform in len * (1 +- range_ratio)."""
    rng = random.Random(seed)
    return _from_gaps([rng.expovariate(rate) for _ in range(n)], prompt_len, output_len, seed, range_ratio)


def bursty(rate: float, n: int, prompt_len: int, output_len: int, cv: float = 3.0, seed: int = 0,
           range_ratio: float = 0.0) -> list[TraceRequest]:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation `cv` (> 1: bursts
    separated by lulls; 1 is Poisson)."""
    shape = 1.0 / (cv * cv)
    rng = random.Random(seed)
    return _from_gaps([rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n)], prompt_len, output_len,
                      seed, range_ratio)


def diurnal(mean_rate: float, duration_s: float, prompt_len: int, output_len: int, period_s: float = 3600.0,
            amplitude: float = 0.8, seed: int = 0, range_ratio: float = 0.0) -> list[TraceRequest]:
    """A day's swing compressed into `period_s`: rate(t) = mean * (1 + amplitude * sin(2 pi t / period)),
    drawn by thinning a Poisson process at the peak rate."""
    if not 0 <= amplitude <= 1:
        raise ValueError("amplitude must be in [0, 1]")
    rng = random.Random(seed)
    peak = mean_rate * (1 + amplitude)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        if rng.random() * peak <= mean_rate * (1 + amplitude * math.sin(2 * math.pi * t / period_s)):
            times.append(t)
    lrng = random.Random(seed + 1)
    return [TraceRequest(a, _lengths(lrng, prompt_len, range_ratio), _lengths(lrng, output_len, range_ratio))
            for a in times]


def _from_gaps(gaps: list[float], prompt_len: int, output_len: int, seed: int,
               range_ratio: float) -> list[TraceRequest]:
    rng = random.Random(seed + 1)
    out, t = [], 0.0
    for g in gaps:
        t += g
        out.append(TraceRequest(t, _lengths(rng, prompt_len, range_ratio), _lengths(rng, output_len,
                                                                                         range_ratio)))
    return out
