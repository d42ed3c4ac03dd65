"""The same serving workloads against several OpenAI-compatible servers in one run (issue #10):
pdserve in any shape, vLLM (`../shared/peer/vllm.sh serve MODEL PORT`), anything else.

Per target, through the same client (`pdserve.loadgen`'s HTTP backend, streaming completions
with token-id prompts, so tokenizers do not matter):
- single-request TTFT at 128, 512 and 2048 prompt tokens: median over 5 distinct prompts (no
  prefix hits), one request at a time, paired: every server is up, each prompt goes to each of
  them back to back in alternating order, 2 s apart (`single_paired`), and `ttft_vs_first` is
  the median of the per-prompt ratios to the first target; single-stream ITL (median) from three
  64-token streams each;
- a rate sweep of random 512-in / 64-out requests (Poisson, as `vllm bench serve` schedules
  them): TTFT p50/p99, TPOT p50, ITL p99, output tokens/s against the offered rate, and whether
  the target keeps up: output >= 95% of what a server that never queues reaches on the same
  schedule (the last request leaves at num_prompts / rate, then takes the target's unloaded time);
- SLO attainment at each rate with SLOs of 3x the *first* target's single-request TTFT at 512
  tokens and 3x its single-stream ITL, and the highest rate at which >= 90% of requests meet both.
Requests are greedy, as `vllm bench serve` sends them, unless --temperature (and --top-p) say
otherwise: an OpenAI client's default is temperature 1.

Writes bench/out/serve.json and serve.png. Run against running servers:
  .venv/bin/python bench/serve.py --target pdserve=http://127.0.0.1:8000 --target vllm=http://127.0.0.1:8100
or let it start the servers: all of them for the paired single requests, then each alone for its
rate sweep (an idle server's threads and daemons would slow a loaded one on a small machine), e.g.:
  --target vllm=http://127.0.0.1:8100 --start vllm="../shared/peer/vllm.sh serve MODEL 8100"
  --target colocated=http://127.0.0.1:8001 --start colocated=".venv/bin/python -m pdserve.cli up --config C.yaml"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent / "out"
TTFT_LENS = (128, 512, 2048)


PAIRS = 5  # prompts per length, each sent to every target
QUIET_S = 2.0  # between requests: vLLM keeps a core busy for ~1 s after each (its OpenMP threads spin)


def _turns(names: list[str], i: int) -> list[str]:
    """The order of the targets for the i-th prompt: reversed every other one."""
    return names if i % 2 == 0 else names[::-1]


async def single_paired(urls: dict[str, str], seed: int, sampling: dict | None = None) -> dict[str, dict]:
    """Single requests to every target, all of them up: TTFT per prompt length and single-stream
    ITL. Each prompt goes to every target back to back, the order alternating from prompt to
    prompt. This host's speed flips between two levels (2x apart) from second to second, so TTFTs
    measured minutes apart in separate turns compare the host's state as much as the servers;
    here a flip moves a ratio only when it falls between a pair's requests. `ttft_vs_first` is,
    per length, the median over prompts of each target's TTFT over the first target's for the
    same prompt."""
    import numpy as np

    from pdserve.loadgen import HttpBackend, Result

    names = list(urls)
    bes = {name: HttpBackend(url) for name, url in urls.items()}
    try:
        infos = {name: await be.info() for name, be in bes.items()}
        vocab = min(v or 32000 for v, _ in infos.values())
        max_len = min(m for _, m in infos.values())
        rng = np.random.default_rng(seed)

        def prompt(n: int) -> list[int]:
            return rng.integers(3, vocab, n).tolist()

        async def one(name: str, tokens: list[int], max_tokens: int) -> Result:
            res = Result(False, len(tokens))
            await bes[name].run(tokens, max_tokens, res, sampling)
            await asyncio.sleep(QUIET_S)
            return res

        for name in names:  # warm-up
            await one(name, prompt(16), 2)
        out = {name: {"ttft_s": {}, "ttft_all_s": {}, "ttft_vs_first": {}} for name in names}
        for n in TTFT_LENS:
            if n + 2 > max_len:
                continue
            times: dict[str, list[float]] = {name: [] for name in names}
            for i in range(PAIRS):
                tokens = prompt(n)
                for name in _turns(names, i):
                    times[name].append((await one(name, tokens, 2)).ttft)
            for name in names:
                out[name]["ttft_all_s"][n] = times[name]
                out[name]["ttft_s"][n] = statistics.median(times[name])
                out[name]["ttft_vs_first"][n] = statistics.median(
                    t / f for t, f in zip(times[name], times[names[0]], strict=True))
        itls: dict[str, list[float]] = {name: [] for name in names}
        for i in range(3):  # three 64-token streams each, alternating
            tokens = prompt(64)
            for name in _turns(names, i):
                itls[name] += (await one(name, tokens, 64)).itl
        for name in names:
            out[name]["itl_s"] = statistics.median(itls[name]) if itls[name] else math.nan
        return out
    finally:
        for be in bes.values():
            await be.close()


async def sweep(url: str, rates: list[float], num_prompts: int, slo_ttft_ms: float, slo_tpot_ms: float,
                seed: int, unloaded_s: float, sampling: dict | None = None) -> list[dict]:
    """unloaded_s: this target's own time for one 512/64 request alone. The schedule sends the last
    request at num_prompts / rate, so even a server that never queues finishes at that plus one
    request's time: its output rate is `reachable_tok_s`, and keeping up means reaching 95% of it."""
    from pdserve.loadgen import Load, Workload, run_benchmark

    rows = []
    for i, rate in enumerate(rates):
        # Other prompts at every rate: a server's prefix cache must not serve the second rate's run.
        report = await run_benchmark(url, Workload(num_prompts, 512, 64, 0.0, 0, seed + 1 + i, **(sampling or {})),
                                     Load(rate, "poisson", None, 2),
                                     "http", slo_ttft_ms, slo_tpot_ms, progress=False)
        s = report["summary"]
        offered = rate * 64
        reachable = num_prompts * 64 / (num_prompts / rate + unloaded_s)
        met = s["goodput_requests"] / max(num_prompts, 1)
        rows.append({"rate": rate, "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                     "tpot_p50_ms": s["tpot_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
                     "output_tok_s": s["output_throughput"], "offered_tok_s": offered, "reachable_tok_s": reachable,
                     "keeps_up": s["output_throughput"] >= 0.95 * reachable and not s["failed"],
                     "failed": s["failed"], "slo_attainment": met})
        print(f"  {url} rate {rate:g}: TTFT p50 {rows[-1]['ttft_p50_ms']:.0f} ms, TPOT p50 "
              f"{rows[-1]['tpot_p50_ms']:.0f} ms, {s['output_throughput']:.0f}/{offered:.0f} tok/s "
              f"(reachable {reachable:.0f}), SLO met {100 * met:.0f}%", flush=True)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, t in result["targets"].items():
        rates = [r["rate"] for r in t["sweep"]]
        axes[0].plot(rates, [r["ttft_p50_ms"] for r in t["sweep"]], "o-", label=name)
        axes[1].plot(rates, [r["tpot_p50_ms"] for r in t["sweep"]], "o-", label=name)
        axes[2].plot(rates, [100 * r["slo_attainment"] for r in t["sweep"]], "o-", label=name)
    for ax, title in zip(axes, ("TTFT p50 (ms)", "TPOT p50 (ms)", "requests meeting both SLOs (%)"), strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run_target(name: str, url: str, args, rates: list[float], result: dict) -> dict:
    """The rate sweep, after the single requests (single_paired); the first target's numbers set the SLOs."""
    t = result["targets"][name]
    # 512 tokens, or the longest prompt the model takes when its context is shorter.
    ttft_512 = t["ttft_s"].get(512, max(t["ttft_s"].values()))
    if "slo_ms" not in result:
        result["slo_ms"] = {"ttft": 3e3 * ttft_512, "tpot": 3e3 * t["itl_s"]}
    slo_ttft, slo_tpot = result["slo_ms"]["ttft"], result["slo_ms"]["tpot"]
    print(f"{name}: rate sweep (SLOs TTFT {slo_ttft:.0f} ms, TPOT {slo_tpot:.1f} ms)", flush=True)
    unloaded = ttft_512 + 63 * t["itl_s"]
    t["sweep"] = asyncio.run(sweep(url, rates, args.num_prompts, slo_ttft, slo_tpot, args.seed, unloaded,
                                   result["sampling"]))
    t["max_rate_kept_up"] = max((r["rate"] for r in t["sweep"] if r["keeps_up"]), default=0.0)
    t["max_rate_90pct_slo"] = max((r["rate"] for r in t["sweep"] if r["slo_attainment"] >= 0.9), default=0.0)
    return t


def sampling(args) -> dict[str, float]:
    """What every request asks for (--temperature, --top-p), in the load generator's terms."""
    from pdserve.loadgen import Workload

    return Workload(temperature=args.temperature, top_p=args.top_p).sampling


class Server:
    """A server this run starts (a shell command in its own process group), waits for until its
    /v1/models answers, and stops (SIGINT, then SIGKILL) when its target is done."""

    def __init__(self, command: str, url: str, timeout_s: float = 600) -> None:
        self.command, self.url, self.timeout_s = command, url, timeout_s

    def __enter__(self) -> Server:
        import subprocess
        import time
        import urllib.request

        print(f"starting: {self.command}", flush=True)
        self.proc = subprocess.Popen(self.command, shell=True, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        end = time.monotonic() + self.timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command!r} exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                return self
            except OSError:
                time.sleep(1)
        self.__exit__()
        raise TimeoutError(f"{self.url} did not answer within {self.timeout_s:.0f}s")

    def __exit__(self, *exc) -> None:
        import os
        import signal
        import time

        # The whole process group, not only its leader: a server's children (vLLM's engine core,
        # pdserve's workers) can outlive the shell for seconds, and the next target's
        # measurements would share the cores with them.
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end and _group_alive(self.proc.pid):
                self.proc.poll()  # reap the leader
                time.sleep(0.2)
            if not _group_alive(self.proc.pid):
                break
        self.proc.poll()


def _group_alive(pgid: int) -> bool:
    import os

    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # members we may not signal are still members
        return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, help="NAME=URL; the first one sets the SLOs")
    ap.add_argument("--rates", default="1,2,3,4")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT / "serve.json"))
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (0: greedy, as `vllm bench serve` sends; OpenAI's default is 1)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--start", action="append", default=[],
                    help="NAME=COMMAND: start that target's server (with all the others for the paired single "
                    "requests, alone for its rate sweep) and stop it after")
    args = ap.parse_args()
    targets = dict(t.split("=", 1) for t in args.target)
    starts = dict(t.split("=", 1) for t in args.start)
    rates = [float(r) for r in args.rates.split(",")]
    result: dict = {"rates": rates, "targets": {}, "started_alone": sorted(starts),
                    "sampling": sampling(args)}
    if starts and set(starts) != set(targets):
        ap.error("with --start, give one for every target (this run starts and stops every server)")
    if starts:
        # Single requests paired, every server up (idle, each costs the other 1-2% of a core);
        # then each server's rate sweep alone: an idle server's threads and daemons would share
        # the cores with a loaded one.
        print("single requests, paired: " + ", ".join(targets), flush=True)
        with contextlib.ExitStack() as stack:
            for name, url in targets.items():
                stack.enter_context(Server(starts[name], url))
            result["targets"] = asyncio.run(single_paired(targets, args.seed, result["sampling"]))
        for name, url in targets.items():
            with Server(starts[name], url):
                run_target(name, url, args, rates, result)
    else:  # servers already running: the paired single requests, then every sweep
        print("single requests, paired: " + ", ".join(targets), flush=True)
        result["targets"] = asyncio.run(single_paired(targets, args.seed, result["sampling"]))
        for name, url in targets.items():
            run_target(name, url, args, rates, result)
    names = list(targets)
    for name in names:
        t = result["targets"][name]
        ttft = ", ".join(f"{n}: {1e3 * s:.0f} ms" for n, s in t["ttft_s"].items())
        vs = ", ".join(f"{n}: {r:.2f}x" for n, r in t.get("ttft_vs_first", {}).items())
        if name != names[0] and vs:
            ttft += f" (paired, vs {names[0]}: {vs})"
        print(f"{name:10s} TTFT {ttft}; ITL {1e3 * t['itl_s']:.1f} ms; keeps up to {t['max_rate_kept_up']:g} req/s; "
              f"90% SLO attainment up to {t['max_rate_90pct_slo']:g} req/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"-> {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
