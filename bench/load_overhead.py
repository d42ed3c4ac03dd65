"""What the serving stack adds under load (issue #10, item 1): a colocated pdserve cluster against
its own engine alone, on the same Poisson schedule of 512-in / 64-out requests, paired.

Each round draws a fresh schedule (RATE req/s, NREQ requests, distinct prompts) and runs it twice,
back to back in alternating order: through the served cluster (`pdserve up`, HTTP streaming, the
same client as `pdserve bench`), and through a bare LLMEngine in a process of its own that adds
each request at its arrival time and steps (no server, no client, no sockets). The cluster is idle
while the engine runs and the other way round. Per round: TTFT p50 and TPOT p50 of each; the
result is the median over rounds of served / engine. This host's speed swings 2x from second to
second: rounds run minutes apart differ by 1.5x, pairs in one round far less.

Writes bench/out/load_overhead.json. Run:
  .venv/bin/python bench/load_overhead.py --config C.yaml [--rounds 8] [--rate 2] [--requests 24]
C.yaml: a colocated cluster on the benchmark model (bench/model_factory.py builds it), e.g.
engine.num_threads 2 and max_num_batched_tokens 2048, as bench/serve.py runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent / "out"
PROMPT, OUTPUT = 512, 64


def schedule(seed: int, rate: float, n: int) -> list[tuple[float, list[int]]]:
    """(arrival offset in seconds, prompt token ids) per request."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        r = random.Random(seed * 1000 + i)
        out.append((t, [r.randrange(3, 30000) for _ in range(PROMPT)]))
    return out


def _replay(eng, params, sch: list[tuple[float, list[int]]], tag: str) -> list[tuple[float, float]]:
    """The engine alone on the schedule: (TTFT, TPOT) per request."""
    start, nxt, first, fin = time.perf_counter(), 0, {}, {}
    while nxt < len(sch) or eng.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(sch) and sch[nxt][0] <= now:
            eng.add_request(f"{tag}-{nxt}", sch[nxt][1], params)
            nxt += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, sch[nxt][0] - now))
            continue
        outs = eng.step()
        now = time.perf_counter() - start
        for o in outs:
            i = int(o.request_id.rsplit("-", 1)[1])
            if i not in first and o.new_token_ids:
                first[i] = now - sch[i][0]
            if o.finished:
                fin[i] = now - sch[i][0]
    return [(first[i], (fin[i] - first[i]) / (OUTPUT - 1)) for i in range(len(sch))]


def engine_process(conn, config: str) -> None:
    """The colocated worker's engine, built from the same config, bare in a clean process: one
    replay per (seed, rate, n) message until None."""
    from engine import LLMEngine, SamplingParams
    from pdcommon.config import load_config

    eng = LLMEngine(load_config(config).engine_config("colocated"))
    eng.generate([[5] * 100], SamplingParams(max_tokens=2))
    params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        conn.send(_replay(eng, params, schedule(*job), f"s{job[0]}"))


async def served(url: str, sch: list[tuple[float, list[int]]]) -> list[tuple[float, float]]:
    from pdserve.loadgen import HttpBackend, Result

    backend, res = HttpBackend(url), [Result(False, PROMPT) for _ in sch]
    start = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + sch[i][0] - time.perf_counter()))
        await backend.run(sch[i][1], OUTPUT, res[i])

    try:
        await asyncio.gather(*(one(i) for i in range(len(sch))))
    finally:
        await backend.close()
    return [(r.ttft, (r.e2e - r.ttft) / (OUTPUT - 1)) for r in res]


def p50s(rows: list[tuple[float, float]]) -> dict[str, float]:
    return {"ttft_p50_ms": 1e3 * statistics.median(r[0] for r in rows),
            "tpot_p50_ms": 1e3 * statistics.median(r[1] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a colocated cluster's YAML")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--requests", type=int, default=24, help="per round and kind")
    ap.add_argument("--out", default=str(OUT / "load_overhead.json"))
    args = ap.parse_args()
    from pdcommon.config import load_config
    from pdcommon.process_env import engine_process_env, missing_from

    if load_config(args.config).mode != "colocated":
        ap.error("--config: a colocated cluster (the engine alone is one colocated worker's engine)")
    want = engine_process_env(1)
    if missing_from(os.environ, want):  # the engine alone gets the malloc settings workers start with
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": want["GLIBC_TUNABLES"]})
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=engine_process, daemon=True, args=(child, args.config))
    proc.start()
    if conn.recv() != "ready":
        raise RuntimeError("the engine process did not start")
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--config", args.config, "--http-port", "0"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rounds = []
    try:
        url = next(line.split("HTTP at ")[1].split("/v1")[0] for line in up.stdout if "HTTP at " in line)
        asyncio.run(served(url, schedule(999, args.rate, 4)))  # warm-up
        for r in range(args.rounds):
            job, got = (100 + r, args.rate, args.requests), {}
            for kind in ("served", "engine") if r % 2 == 0 else ("engine", "served"):
                time.sleep(1.0)
                if kind == "engine":
                    conn.send(job)
                    got[kind] = p50s(conn.recv())
                else:
                    got[kind] = p50s(asyncio.run(served(url, schedule(*job))))
            rounds.append(got)
            print(f"round {r}: TTFT p50 served {got['served']['ttft_p50_ms']:.0f} / engine "
                  f"{got['engine']['ttft_p50_ms']:.0f} ms; TPOT p50 served {got['served']['tpot_p50_ms']:.1f} / "
                  f"engine {got['engine']['tpot_p50_ms']:.1f} ms", flush=True)
    finally:
        conn.send(None)
        up.send_signal(signal.SIGINT)
        up.wait(120)
    result = {"config": args.config, "rate": args.rate, "requests_per_round": args.requests,
              "prompt_tokens": PROMPT, "output_tokens": OUTPUT, "rounds": rounds,
              **{f"{k}_served_over_engine": statistics.median(x["served"][f"{k}_p50_ms"] / x["engine"][f"{k}_p50_ms"]
                                                              for x in rounds) for k in ("ttft", "tpot")}}
    print(f"served / engine alone (median of rounds): TTFT p50 {result['ttft_served_over_engine']:.3f}, "
          f"TPOT p50 {result['tpot_served_over_engine']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
