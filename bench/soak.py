"""Soak: a 2 prefill + 2 decode Ray cluster serving stories260K on the default config, hit with
everything at once: a burst of concurrent streams, clients that cancel or disconnect, a decode
SIGKILL, a prefill SIGKILL, a decode SIGSTOP/SIGCONT and a 5 MB prompt.

It reports completed / clean errors (with reasons) / hung / wrong output / leaked. Every completed
output is compared with the engine alone. Leaks are read from outside the processes: the router's
/metrics (blocks held by no live request, referenced blocks, partial transfers, peer sockets,
router in-flight entries) and each surviving worker's open file descriptors and RSS before and
after. Writes bench/out/soak.json and prints a one-line summary.

Run: .venv/bin/python bench/soak.py [--streams 500] [--max-tokens 64] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out"
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
HUNG_S = 150.0  # a client with no answer for this long is hung
STOP_S = 12.0  # the SIGSTOP lasts longer than the default stall timeout and heartbeat window


def metrics(http: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(http + "/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def worker_gauge(m: dict, name: str) -> dict[str, float]:
    return {dict(k[1])["worker"]: v for k, v in m.items() if k[0] == f"pdserve:worker_{name}"}


def plan_requests(n: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """Prompts cut from one long story; a fifth sampled with a seed; 10% of clients leave early."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=str(STORIES)))
    story = eng.tokenize("Once upon a time")
    story += eng.generate([story], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))[0]["token_ids"]
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        start = rng.randrange(0, 150)
        sampled = i % 5 == 4
        kind = "complete" if i % 10 else rng.choice(["cancel", "disconnect"])
        reqs.append({"i": i, "prompt": story[start:start + rng.randrange(4, 120)], "kind": kind,
                     "leave_after": rng.randrange(1, max_tokens // 2),
                     "sampling": {"max_tokens": max_tokens, "ignore_eos": True,
                                  "temperature": 0.8 if sampled else 0.0, **({"seed": 1000 + i} if sampled else {})}})
    params = [SamplingParams(**r["sampling"]) for r in reqs]
    refs = eng.generate([r["prompt"] for r in reqs], params)
    for r, ref in zip(reqs, refs, strict=True):
        r["ref"] = ref["token_ids"]
    return reqs


async def grpc_client(stub, r: dict, result: dict) -> None:
    import grpc

    from pdcommon.client import make_request

    call = stub.Generate(make_request(r["prompt"], request_id=f"soak-{r['i']}", **r["sampling"]),
                         timeout=HUNG_S + 30)
    tokens: list[int] = []
    result["tokens_so_far"] = tokens
    try:
        async for msg in call:
            tokens += msg.token_ids
            if r["kind"] == "cancel" and len(tokens) >= r["leave_after"]:
                call.cancel()
                result.update(outcome="left")
                return
        result.update(outcome="completed", tokens=tokens)
    except grpc.aio.AioRpcError as e:
        result.update(outcome="error", reason=f"{e.code().name}: {e.details()[:80]}")


async def http_client(session, http: str, r: dict, result: dict) -> None:
    """Streams over HTTP and disconnects after a few events."""
    body = {"prompt": r["prompt"], "stream": True, **r["sampling"]}
    async with session.post(http + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            result.update(outcome="error", reason=f"HTTP {resp.status}")
            return
        events = 0
        async for line in resp.content:
            events += line.startswith(b"data: {")
            if events >= r["leave_after"]:
                break
    result.update(outcome="left")


async def huge_prompt(http: str) -> dict:
    import aiohttp

    await asyncio.sleep(1.2)  # in the middle of the burst and the faults
    text = "Once upon a time there was a big dog. " * (5 * 2**20 // 38)
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(http + "/v1/completions",
                                                   json={"prompt": text, "max_tokens": 8}) as resp:
        body = await resp.json()
    return {"status": resp.status, "seconds": round(time.monotonic() - t0, 3),
            "message": body.get("error", {}).get("message", "")[:120]}


async def faults(pids: dict[str, int], log: list) -> None:
    def act(at: float, what: str, name: str, sig: int) -> None:
        os.kill(pids[name], sig)
        log.append({"t": round(at, 2), "fault": what, "worker": name})

    t0 = time.monotonic()
    await asyncio.sleep(1.0)
    act(time.monotonic() - t0, "SIGKILL", "decode-0", signal.SIGKILL)
    await asyncio.sleep(0.5)
    act(time.monotonic() - t0, "SIGKILL", "prefill-0", signal.SIGKILL)
    await asyncio.sleep(1.0)
    act(time.monotonic() - t0, "SIGSTOP", "decode-1", signal.SIGSTOP)
    await asyncio.sleep(STOP_S)
    act(time.monotonic() - t0, "SIGCONT", "decode-1", signal.SIGCONT)


async def monitor(stub, timeline: list, stop: asyncio.Event) -> None:
    """Where requests are every 2 s: the router's queue and each worker's load."""
    from pdcommon.v1 import router_pb2 as pb

    t0 = time.monotonic()
    while not stop.is_set():
        try:
            st = await stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
            timeline.append({"t": round(time.monotonic() - t0, 1), "queued": st.queued_requests,
                             "workers": {w.worker_id: [w.inflight, w.num_running, w.num_waiting, w.state[0]]
                                         for w in st.workers}})
        except Exception as e:  # the router is restarting, say
            timeline.append({"t": round(time.monotonic() - t0, 1), "error": type(e).__name__})
        try:
            await asyncio.wait_for(stop.wait(), 2.0)
        except TimeoutError:
            pass


async def drive(address: str, http: str, reqs: list[dict], pids: dict[str, int]) -> tuple[dict, dict, list]:
    import aiohttp
    import grpc

    from pdcommon.v1 import router_pb2_grpc as rrpc

    results = {r["i"]: {} for r in reqs}
    fault_log: list = []
    async with grpc.aio.insecure_channel(address) as ch, aiohttp.ClientSession() as session:
        stub = rrpc.RouterStub(ch)

        async def one(r: dict) -> None:
            try:
                coro = http_client(session, http, r, results[r["i"]]) if r["kind"] == "disconnect" \
                    else grpc_client(stub, r, results[r["i"]])
                await asyncio.wait_for(coro, HUNG_S)
            except TimeoutError:
                results[r["i"]].update(outcome="hung")

        fault_task = asyncio.create_task(faults(pids, fault_log))
        huge = asyncio.create_task(huge_prompt(http))
        stop, timeline = asyncio.Event(), []
        mon = asyncio.create_task(monitor(stub, timeline, stop))
        await asyncio.gather(*(one(r) for r in reqs))
        stop.set()
        await mon
        huge_result = await huge
        await fault_task
    return results, huge_result, fault_log + [{"timeline": timeline}]


def warm_up(address: str, reqs: list[dict]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from pdcommon.client import RouterClient, make_request

    with RouterClient(address) as c, ThreadPoolExecutor(len(reqs)) as pool:
        list(pool.map(lambda r: c.generate(make_request(r["prompt"], max_tokens=4), timeout=60), reqs))


def judge(reqs: list[dict], results: dict) -> dict:
    out = {"total": len(reqs), "left_by_client": 0, "completed": 0, "wrong_output": 0, "hung": 0,
           "clean_errors": {}}
    for r in reqs:
        res = results[r["i"]]
        outcome = res.get("outcome", "hung")
        if outcome == "left":
            out["left_by_client"] += 1
        elif outcome == "completed":
            out["completed"] += 1
            out["wrong_output"] += res["tokens"] != r["ref"]
        elif outcome == "hung":
            out["hung"] += 1
        else:
            out["clean_errors"][res["reason"]] = out["clean_errors"].get(res["reason"], 0) + 1
    out["hung_detail"] = [{"i": r["i"], "tokens": len(results[r["i"]].get("tokens_so_far", []))}
                          for r in reqs if results[r["i"]].get("outcome", "hung") == "hung"][:40]
    out["wrong_detail"] = [{"i": r["i"], "got": len(res["tokens"]), "first_diff": next(
        (k for k, (a, b) in enumerate(zip(res["tokens"], r["ref"], strict=False)) if a != b), None)}
        for r in reqs if (res := results[r["i"]]).get("outcome") == "completed" and res["tokens"] != r["ref"]][:40]
    meant = sum(1 for r in reqs if r["kind"] == "complete")
    out["completion_rate"] = round(out["completed"] / meant, 4)
    return out


def settle_and_check_leaks(http: str, before: dict, timeout_s: float = 90.0) -> dict:
    """Wait for the cluster to go idle, then read every leak gauge (fds against the baseline)."""
    end = time.monotonic() + timeout_s
    while True:
        m = metrics(http)
        held = {k: v for name in ("used_blocks", "orphan_blocks", "partial_transfers")
                for k, v in worker_gauge(m, name).items() if v}
        router = {name: m.get((f"pdserve:{name}", ()), 0) for name in ("router_inflight_entries",
                                                                      "router_active_requests")}
        decode_workers = sum(1 for k in m if k[0] == "pdserve:worker_used_blocks" and dict(k[1])["pool"] == "decode")
        sockets = worker_gauge(m, "peer_sockets")
        extra_sockets = any(v > decode_workers for v in sockets.values())
        if (not held and not any(router.values()) and not extra_sockets) or time.monotonic() > end:
            break
        time.sleep(1.0)
    fds, rss = worker_gauge(m, "open_fds"), worker_gauge(m, "rss_bytes")
    fd_growth = {w: fds[w] - before["fds"][w] for w in fds if w in before["fds"]}
    leaked = {
        "blocks_held_by_no_live_request": sum(worker_gauge(m, "orphan_blocks").values()),
        "blocks_referenced_when_idle": sum(worker_gauge(m, "used_blocks").values()),
        "partial_transfers": sum(worker_gauge(m, "partial_transfers").values()),
        "router_inflight_entries": router["router_inflight_entries"],
        "router_active_requests": router["router_active_requests"],
        "peer_sockets_beyond_live_decode_workers": sum(max(v - decode_workers, 0) for v in sockets.values()),
        "fd_growth_over_4": {w: g for w, g in fd_growth.items() if g > 4},
    }
    return {"leaked": leaked, "clean": not any(v for v in leaked.values()),
            "workers_after": {w: {"open_fds": fds[w], "rss_mib": round(rss.get(w, 0) / 2**20, 1)} for w in fds},
            "fd_growth": fd_growth}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(OUT / "soak.json"))
    args = ap.parse_args()

    from pdcommon.config import load_config
    from pdserve.launch.cluster import RayCluster

    reqs = plan_requests(args.streams, args.max_tokens)
    # The default config; only ports (free ones) and the pool sizes the issue asks for are set.
    cfg = load_config(ROOT / "configs" / "local.yaml", **{"model": str(STORIES), "router.port": 0,
                                                           "router.http_port": 0, "prefill.replicas": 2,
                                                           "decode.replicas": 2})
    t_start = time.monotonic()
    with RayCluster(cfg) as cluster:
        http = cluster.http_address
        pids = cluster.worker_pids()
        warm_up(cluster.address, reqs[:16])  # every prefill -> decode connection exists before the baseline
        time.sleep(2.5)  # a heartbeat or two: the gauges below are the warmed-up state
        m = metrics(http)
        before = {"fds": worker_gauge(m, "open_fds"),
                  "rss_mib": {w: round(v / 2**20, 1) for w, v in worker_gauge(m, "rss_bytes").items()}}
        t0 = time.monotonic()
        results, huge, fault_log = asyncio.run(drive(cluster.address, http, reqs, pids))
        run_s = time.monotonic() - t0
        verdict = judge(reqs, results)
        leaks = settle_and_check_leaks(http, before)
        with urllib.request.urlopen(http + "/health", timeout=10) as resp:
            healthy = json.loads(resp.read())["ready"]
    report = {"streams": args.streams, "max_tokens": args.max_tokens, "run_s": round(run_s, 1),
              "wall_s": round(time.monotonic() - t_start, 1), "faults": fault_log, "huge_prompt": huge,
              **verdict, **leaks, "workers_before": before, "healthy_after": healthy,
              "config_changes": "none (default config; pools 2+2 as the issue asks)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    errors = sum(verdict["clean_errors"].values())
    print(f"soak: {args.streams} streams, completed {verdict['completed']} "
          f"({verdict['completion_rate']:.2%} of those not left by their client), left {verdict['left_by_client']}, "
          f"clean errors {errors} {verdict['clean_errors'] or ''}, hung {verdict['hung']}, "
          f"wrong {verdict['wrong_output']}, leaked {'nothing' if leaks['clean'] else leaks['leaked']}, "
          f"5 MB prompt -> {huge['status']} in {huge['seconds']}s; {args.out}")


if __name__ == "__main__":
    main()
