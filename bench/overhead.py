"""Per-token overhead of the serving stack on stories260K, whose compute is negligible, so what
is measured is the stack itself (issue #10, target 4):

- the engine alone, in a clean process of its own: seconds per decode step of one stream;
- the same stream through a 1 prefill + 1 decode cluster (Ray actors), over HTTP streaming:
  inter-token latency as the client sees it; the ratio is what the stack adds. The two alternate,
  ROUNDS times, and the ratio is the median of each round's pair: this host's speed flips
  between two levels (the engine's step alone 0.82 or 1.55 ms, pinned to a core or not, from
  one second to the next), and an engine measured once before the cluster started gave "the
  stack adds" anywhere from -24% to +66%;
- the same stream against the decode worker's own steps, which its engine times in the serving
  process (`pdserve:engine_busy_seconds` over `pdserve:engine_steps` from the router's
  /metrics): the stream's mean ITL over that mean step is what the rest of the stack adds, the
  step's own slowdown in the worker (most of it the token message's wake-up, bench/wake_cost.py)
  not counted;
- a 1-token request over HTTP (non-streaming), p50 over 50 requests;
- 8-token requests at concurrency 16 and 64: requests/s.

Writes bench/out/overhead.json. Run: .venv/bin/python bench/overhead.py

`--compare-event-loops 6` instead runs process clusters on uvloop and on asyncio's loop
(process.event_loop), alternating, and writes bench/out/overhead_event_loops.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent / "out"
MODEL = ROOT.parent / "shared" / "models" / "stories260K"
PROMPT = "Once upon a time there was a little girl named Lily"
STREAM_TOKENS = 200


ROUNDS = 5


class EngineProcess:
    """EngineAlone in a spawned process: in this one, the Ray driver's threads took the GIL from
    the engine's steps (1.6 ms a step in every round, against 0.82-1.55 in a process alone)."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=EngineAlone.serve, args=(child,), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("the engine process did not start")

    def step_s(self) -> float:
        self.conn.send(True)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(False)
        self.proc.join(30)


class EngineAlone:
    """The engine in this process, one thread, as a worker runs it."""

    def __init__(self) -> None:
        from engine import EngineConfig, LLMEngine, SamplingParams

        self.eng = LLMEngine(EngineConfig(model=str(MODEL), num_threads=1))
        self.params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True)
        self.ids = self.eng.tokenizer.encode(PROMPT)
        self.runs = 0
        self.eng.add_request("warm", self.ids, SamplingParams(max_tokens=8, temperature=0))
        while self.eng.has_unfinished():
            self.eng.step()

    @staticmethod
    def serve(conn) -> None:
        """A clean process of its own (no Ray driver threads, no event loop): one measurement
        per message until the pipe closes."""
        engine = EngineAlone()
        conn.send("ready")
        while conn.recv():
            conn.send(engine.step_s())

    def step_s(self) -> float:
        """Median seconds per decode step of one stream."""
        self.runs += 1
        self.eng.add_request(f"r{self.runs}", self.ids, self.params)
        times, last = [], None
        while self.eng.has_unfinished():
            self.eng.step()
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
        return statistics.median(times[1:])  # the first step is the prefill


async def stream_itl(session, url: str) -> tuple[float, float]:
    """The stream's inter-token time: median and mean."""
    body = {"prompt": PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    gaps, last = [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return statistics.median(gaps), statistics.fmean(gaps)


async def decode_engine_counters(session, url: str) -> tuple[float, float]:
    """(steps, busy seconds) of the decode pool's engines, from the router's /metrics: what the
    workers' engines timed of their own steps, in the serving process (sent with heartbeats)."""
    from soak import metrics  # bench/soak.py's /metrics reader

    got = {"pdserve:engine_steps_total": 0.0, "pdserve:engine_busy_seconds_total": 0.0}
    for (name, labels), value in (await asyncio.to_thread(metrics, url)).items():
        if name in got and dict(labels).get("pool") == "decode":
            got[name] += value
    return got["pdserve:engine_steps_total"], got["pdserve:engine_busy_seconds_total"]


async def after_stream(session, url: str, before: tuple[float, float]) -> tuple[float, float]:
    """The counters once a heartbeat has brought in every decode step of the stream since
    `before` (all but its first token, which the prefill worker made)."""
    deadline = time.monotonic() + 10
    while True:
        now = await decode_engine_counters(session, url)
        if now[0] - before[0] >= STREAM_TOKENS - 1:
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"the decode engine counted {now[0] - before[0]:.0f} steps for a stream of "
                               f"{STREAM_TOKENS} tokens")
        await asyncio.sleep(0.2)


async def one_token_p50(session, url: str, n: int = 50) -> float:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        async with session.post(url + "/v1/completions", json={"prompt": f"{PROMPT} {i}", "max_tokens": 1}) as r:
            await r.read()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


async def throughput(session, url: str, concurrency: int, n: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem, session.post(url + "/v1/completions",
                                     json={"prompt": f"{PROMPT} {i}", "max_tokens": 8, "ignore_eos": True}) as r:
            await r.read()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def against(url: str, engine: EngineProcess) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        seen = await decode_engine_counters(s, url)
        await stream_itl(s, url)  # warm-up
        seen = await after_stream(s, url, seen)
        rounds = []
        for _ in range(ROUNDS):  # engine and stack back to back: the same host speed for both
            step = engine.step_s()
            itl, itl_mean = await stream_itl(s, url)
            now = await after_stream(s, url, seen)
            rounds.append({"engine_step_s": step, "stream_itl_s": itl, "stream_itl_mean_s": itl_mean,
                           "worker_step_mean_s": (now[1] - seen[1]) / (now[0] - seen[0])})
            seen = now
        return {"rounds": rounds,
                "engine_step_s": statistics.median(r["engine_step_s"] for r in rounds),
                "stream_itl_s": statistics.median(r["stream_itl_s"] for r in rounds),
                "stack_overhead": statistics.median(r["stream_itl_s"] / r["engine_step_s"] - 1 for r in rounds),
                # The same stream against its own steps in the decode worker (means: the worker
                # reports a sum), what the worker's step time leaves to the rest of the stack.
                # The step itself runs slower there than alone (bench/wake_cost.py: the token
                # message's wake-up slows the next step), which this figure does not count.
                "worker_step_mean_s": statistics.median(r["worker_step_mean_s"] for r in rounds),
                "stack_overhead_over_worker_step": statistics.median(
                    r["stream_itl_mean_s"] / r["worker_step_mean_s"] - 1 for r in rounds),
                "one_token_p50_s": await one_token_p50(s, url),
                "rps_c16": await throughput(s, url, 16, 200), "rps_c64": await throughput(s, url, 64, 400)}


def _against_processes(engine: EngineProcess, event_loop: str | None = None) -> dict:
    """The same measurements against `pdserve up --launcher process` (router in `up`, workers its
    children), started here and stopped after; `event_loop` sets process.event_loop."""
    import signal
    import subprocess
    import tempfile

    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pdbench-") as conf:
        cfg = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
        if event_loop:
            cfg.setdefault("process", {})["event_loop"] = event_loop
        yaml.safe_dump(cfg, conf)
        conf.flush()
        up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--launcher", "process", "--config",
                               conf.name, "--model", str(MODEL), "--port", "0", "--http-port", "0",
                               "--control-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
        try:
            url = next(line.split("HTTP at ")[1].split("/v1")[0] for line in up.stdout if "HTTP at " in line)
            return asyncio.run(against(url, engine))
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(120)


def compare_event_loops(engine: EngineProcess, pairs: int) -> dict:
    """process.event_loop uvloop against asyncio, process clusters one after the other, the
    order alternating; per metric the medians and how many pairs uvloop won. (The client here
    runs on asyncio's loop either way.) This host's speed moves from one minute to the next,
    so one pair says little."""
    runs: dict[str, list[dict]] = {"uvloop": [], "asyncio": []}
    for i in range(pairs):
        for kind in (("uvloop", "asyncio") if i % 2 == 0 else ("asyncio", "uvloop")):
            runs[kind].append(_against_processes(engine, kind))
            r = runs[kind][-1]
            print(f"pair {i} {kind:8s}: 1-token p50 {r['one_token_p50_s'] * 1e3:.1f} ms, req/s c16 "
                  f"{r['rps_c16']:.0f} c64 {r['rps_c64']:.0f}, stream ITL {r['stream_itl_s'] * 1e3:.2f} ms")
    out: dict = {"pairs": pairs, "runs": runs}
    for key, lower in (("one_token_p50_s", True), ("rps_c16", False), ("rps_c64", False), ("stream_itl_s", True)):
        uv, std = [r[key] for r in runs["uvloop"]], [r[key] for r in runs["asyncio"]]
        out[key] = {"uvloop": statistics.median(uv), "asyncio": statistics.median(std),
                    "uvloop_better": sum((a < b) if lower else (a > b) for a, b in zip(uv, std, strict=True))}
        print(f"{key}: uvloop {out[key]['uvloop']:.4g}, asyncio {out[key]['asyncio']:.4g} "
              f"(uvloop better in {out[key]['uvloop_better']} of {pairs} pairs)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(OUT / "overhead.json"))
    ap.add_argument("--launcher", choices=["ray", "process"], default="ray",
                    help="how the cluster runs: Ray actors, or `pdserve up --launcher process`")
    ap.add_argument("--compare-event-loops", type=int, default=0, metavar="PAIRS",
                    help="instead: process clusters on uvloop and on asyncio's loop, PAIRS of each")
    args = ap.parse_args()
    engine = EngineProcess()
    if args.compare_event_loops:
        result = compare_event_loops(engine, args.compare_event_loops)
        engine.close()
        return write_json(result, Path(args.out).with_name("overhead_event_loops.json")
                      if args.out == str(OUT / "overhead.json") else Path(args.out))
    if args.launcher == "ray":
        from pdcommon.config import load_config
        from pdserve.launch.cluster import RayCluster

        cfg = load_config(ROOT / "configs" / "local.yaml", **{"model": str(MODEL), "router.port": 0,
                                                               "router.http_port": 0})
        with RayCluster(cfg) as cluster:
            r = asyncio.run(against(cluster.http_address, engine))
    else:
        r = _against_processes(engine)
    engine.close()
    result = {"launcher": args.launcher, **r}
    for i, row in enumerate(r["rounds"]):
        print(f"round {i}: engine step {row['engine_step_s'] * 1e3:.2f} ms, "
              f"stream ITL {row['stream_itl_s'] * 1e3:.2f} ms; means: the decode worker's step "
              f"{row['worker_step_mean_s'] * 1e3:.2f} ms, stream ITL {row['stream_itl_mean_s'] * 1e3:.2f} ms")
    print(f"engine step {r['engine_step_s'] * 1e3:.2f} ms; stream ITL {r['stream_itl_s'] * 1e3:.2f} ms "
          f"(stack adds {100 * result['stack_overhead']:.0f}%, median of the rounds' pairs; "
          f"{100 * result['stack_overhead_over_worker_step']:.0f}% over the decode worker's own step); "
          f"1-token request p50 {r['one_token_p50_s'] * 1e3:.1f} ms; "
          f"8-token req/s at c16 {r['rps_c16']:.1f}, c64 {r['rps_c64']:.1f}")
    return write_json(result, Path(args.out))


def write_json(result: dict, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
