"""`pdserve bench`: load a running router like `vllm bench serve` and report TTFT, TPOT, ITL and
E2E percentiles, throughput and goodput (requests/s meeting both the TTFT and TPOT SLO)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(slots=True)
class Workload:
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0  # lengths drawn uniformly from [len*(1-r), len*(1+r)]
    shared_prefix_len: int = 0  # every prompt starts with the same prefix of this many tokens
    seed: int = 0
    temperature: float = 0.0  # 0: greedy (as `vllm bench serve` sends); OpenAI clients default to 1
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")

    @property
    def sampling(self) -> dict[str, float]:
        """What each request asks for, in the OpenAI API's names."""
        return {"temperature": self.temperature, **({"top_p": self.top_p} if self.top_p < 1.0 else {})}

    def requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed)

        def length(n: int) -> int:
            lo, hi = max(1, int(n * (1 - self.range_ratio))), max(1, int(n * (1 + self.range_ratio)))
            return rng.randint(lo, hi)

        prefix = [rng.randrange(3, vocab_size) for _ in range(self.shared_prefix_len)]
        out = []
        for _ in range(self.num_prompts):
            n = length(self.input_len)
            out.append((prefix + [rng.randrange(3, vocab_size) for _ in range(n)], length(self.output_len)))
        return out


@dataclass(slots=True)
class Load:
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    arrival: str = "poisson"  # poisson | constant
    max_concurrency: int | None = None
    warmup: int = 2

    def __post_init__(self) -> None:
        if self.arrival not in ("poisson", "constant"):
            raise ValueError("arrival must be 'poisson' or 'constant'")
        if self.request_rate <= 0:
            raise ValueError("request_rate must be > 0")


    def offsets(self, n: int, seed: int) -> list[float]:
        """When each of n requests is sent, in seconds from the start, as `vllm bench serve` does it:
        exponential (or constant) gaps, summed, then scaled so the last request goes out at exactly
        n / rate (the sampled sum misses that by a few percent, which moves req/s from seed to
        seed). Nothing waits after the last request."""
        if not math.isfinite(self.request_rate):
            return [0.0] * n
        if self.arrival == "poisson":
            gaps = np.random.default_rng(seed).exponential(1.0 / self.request_rate, n)
        else:
            gaps = np.full(n, 1.0 / self.request_rate)
        t = np.cumsum(gaps)
        if t[-1] > 0:
            t *= (n / self.request_rate) / t[-1]
        return t.tolist()


@dataclass(slots=True)
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    start: float = 0.0  # seconds since the benchmark began
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


class GrpcBackend:
    def __init__(self, address: str) -> None:
        import grpc

        from pdcommon.client import auth_metadata
        from pdcommon.v1 import router_pb2_grpc as rrpc

        self.channel = grpc.aio.insecure_channel(address.removeprefix("grpc://"))
        self.stub = rrpc.RouterStub(self.channel)
        self.metadata = auth_metadata()  # PDSERVE_API_KEY, when the router wants one

    async def info(self) -> tuple[int, int]:
        from pdcommon.v1 import router_pb2 as pb

        st = await self.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30, metadata=self.metadata)
        return st.vocab_size, st.max_model_len

    async def run(self, prompt: list[int], max_tokens: int, res: Result, sampling: dict | None = None) -> None:
        """sampling: temperature and top_p (Workload.sampling); greedy when None."""
        from pdcommon.client import make_request

        t0 = time.perf_counter()
        last = t0
        request = make_request(prompt, max_tokens=max_tokens, ignore_eos=True, **(sampling or {}))
        async for msg in self.stub.Generate(request, metadata=self.metadata):
            now = time.perf_counter()
            n = len(msg.token_ids)
            if res.output_len == 0:
                res.ttft = now - t0
            elif n:
                res.itl += [(now - last) / n] * n
            res.output_len += n
            last = now
        res.e2e = last - t0
        res.ok = True

    async def close(self) -> None:
        await self.channel.close()


class HttpBackend:
    def __init__(self, url: str) -> None:
        import aiohttp

        self.url = url.rstrip("/")
        key = os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             headers={"Authorization": f"Bearer {key}"} if key else None)
        self.model = ""

    async def info(self) -> tuple[int, int]:
        async with self.session.get(f"{self.url}/v1/models") as r:
            m = (await r.json())["data"][0]
        self.model = m["id"]
        return m.get("vocab_size", 0), m["max_model_len"]

    async def run(self, prompt: list[int], max_tokens: int, res: Result, sampling: dict | None = None) -> None:
        """sampling: temperature and top_p (Workload.sampling); greedy when None."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                **(sampling or {"temperature": 0}), "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        last = t0
        chunks = 0
        async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                now = time.perf_counter()
                if event.get("usage"):
                    res.output_len = event["usage"]["completion_tokens"]
                if not event.get("choices"):
                    continue
                if chunks == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                chunks += 1
                last = now
        res.output_len = res.output_len or chunks
        res.e2e = last - t0
        res.ok = True

    async def close(self) -> None:
        await self.session.close()


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], duration: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if (slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms)
            and (slo_tpot_ms is None or r.tpot * 1e3 <= slo_tpot_ms)]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": len(good) / duration, "goodput_requests": len(good),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "ttft_ms": _pcts([r.ttft for r in ok]), "tpot_ms": _pcts([r.tpot for r in ok if r.output_len > 1]),
        "itl_ms": _pcts([x for r in ok for x in r.itl]), "e2e_ms": _pcts([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def _progress(done: int, total: int) -> None:
    """A bar redrawn in place on a terminal; into a log or pipe, a line per tenth of the run."""
    if not sys.stderr.isatty():
        if done == total or int(10 * done / total) > int(10 * (done - 1) / total):
            sys.stderr.write(f"{done}/{total} requests done\n")
            sys.stderr.flush()
        return
    width = 30
    filled = int(width * done / total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


async def run_benchmark(target: str, workload: Workload, load: Load, backend: str = "grpc",
                        slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                        progress: bool = True) -> dict:
    be = HttpBackend(target) if backend == "http" else GrpcBackend(target)
    try:
        vocab, max_len = await be.info()
        reqs = workload.requests(vocab or 32000)
        too_long = [len(p) + m for p, m in reqs if len(p) + m > max_len]
        if too_long:
            raise ValueError(f"{len(too_long)} requests exceed the model's context length {max_len}")
        for p, m in reqs[: load.warmup]:
            await be.run(p, min(m, 4), Result(False, len(p)), workload.sampling)
        sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        results: list[Result] = []
        done = 0
        t_begin = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int) -> None:
            nonlocal done
            res = Result(False, len(prompt), start=time.perf_counter() - t_begin)
            try:
                if sem is not None:
                    async with sem:
                        res.start = time.perf_counter() - t_begin
                        await be.run(prompt, max_tokens, res, workload.sampling)
                else:
                    await be.run(prompt, max_tokens, res, workload.sampling)
            except Exception as e:  # recorded, counted as failed
                res.ok, res.error = False, f"{type(e).__name__}: {str(e)[:200]}"
            results.append(res)
            done += 1
            if progress:
                _progress(done, len(reqs))

        tasks = []
        for (p, m), at in zip(reqs, load.offsets(len(reqs), workload.seed), strict=True):
            wait = at - (time.perf_counter() - t_begin)  # absolute times: no drift from late wake-ups
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(p, m)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_begin
    finally:
        await be.close()
    summary = summarize(results, duration, slo_ttft_ms, slo_tpot_ms)
    return {"config": {"target": target, "backend": backend, "workload": asdict(workload), "load": asdict(load)},
            "summary": summary, "requests": [{**asdict(r), "tpot": r.tpot} for r in sorted(results,
                                                                                        key=lambda r: r.start)]}


def _slo_text(slo: dict) -> str:
    parts = [f"{name}<={slo[key]:g} ms" for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))
             if slo[key] is not None]
    return f"within {', '.join(parts)}" if parts else "completed; no SLO given (--slo-ttft-ms, --slo-tpot-ms)"


def format_table(report: dict) -> str:
    s = report["summary"]
    lines = [f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f}s",
             f"throughput {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
             f"{s['total_token_throughput']:.1f} total tok/s",
             f"goodput {s['goodput']:.2f} req/s ({s['goodput_requests']}/{s['completed']} {_slo_text(s['slo'])})",
             f"{'metric (ms)':12s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = s[key]
        lines.append(f"{key[:-3].upper():12s} {p['mean']:9.2f} {p['p50']:9.2f} {p['p90']:9.2f} {p['p99']:9.2f}")
    return "\n".join(lines)


def plot_report(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in report["requests"] if r["ok"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        vals = np.sort([r[key] * 1e3 for r in reqs])
        if len(vals):
            axes[0].plot(vals, np.arange(1, len(vals) + 1) / len(vals), label=label)
    axes[0].set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests", title="Latency CDFs")
    axes[0].legend()
    starts = [r["start"] for r in reqs]
    axes[1].scatter(starts, [r["ttft"] * 1e3 for r in reqs], s=8)
    axes[1].set(xlabel="request start (s)", ylabel="TTFT (ms)", title="TTFT over time")
    axes[2].scatter(starts, [r["tpot"] * 1e3 for r in reqs], s=8, color="tab:orange")
    axes[2].set(xlabel="request start (s)", ylabel="TPOT (ms)", title="TPOT over time")
    slo = report["summary"]["slo"]
    if slo["ttft_ms"]:
        axes[1].axhline(slo["ttft_ms"], color="red", ls="--")
    if slo["tpot_ms"]:
        axes[2].axhline(slo["tpot_ms"], color="red", ls="--")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: str, labels: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [r["config"]["load"]["request_rate"] for r in rows]
    ax.plot(rates, [r["summary"]["goodput"] for r in rows], "o-", label="goodput")
    ax.plot(rates, [r["summary"]["request_throughput"] for r in rows], "s--", label="throughput")
    ax.set(xlabel="request rate (req/s)", ylabel="req/s", title="Goodput vs request rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
