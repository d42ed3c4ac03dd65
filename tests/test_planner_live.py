"""The SLA planner in a live Ray cluster: a load step (low, prompt-heavy, output-heavy, low)
grows the prefill pool, then the decode pool, then shrinks both, and no request fails.

On two cores compute stops growing at two busy workers, so the engines run with the device
emulation option (EngineConfig.emulate_device_s_per_token): each step also sleeps 2 ms per token
it computes, a slower chip whose capacity grows with replicas. The planner's profile is measured
on that emulated device with `pdserve profile`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from pdcommon.client import RouterClient, make_request
from pdcommon.config import load_config
from pdserve.launch.cluster import RayCluster

ROOT = Path(__file__).resolve().parent.parent
PHASES = [  # (name, seconds, rate, prompt tokens, output tokens)
    ("low", 10, 0.5, 64, 8),
    ("prompts", 30, 4.0, 256, 1),  # one token: no decode work at all (it skips the decode pool)
    # 12 req/s x 96 tokens asks ~2.3x what one emulated decode worker makes at its largest batch
    # (2 ms a token: ~500 tokens/s), so it must grow whatever the host's speed. At 64 tokens
    # (1.5x) the router saw 4-11 req/s through the client's pacing on a slow day, and a forecast
    # that lags the step planned 6-8: the pool stayed at one in some CI runs.
    ("outputs", 30, 12.0, 16, 96),
    # Quiet for the decode pool (1/64 of the output-heavy phase's tokens), yet a request every
    # second: the planner shrinks a pool only after blocks of finished requests have shown it
    # that the burst's latency (six workers sharing two cores) is gone, and at 0.3 req/s 45 s
    # held two or three such blocks, sometimes none it could learn from.
    ("quiet", 45, 1.0, 64, 8),
]
# How long after the load the pools may take to be back at one replica each. Shrinking decode
# from 3 to 1 takes two steps, each after scale_down_window_s (24) of plans that need fewer and
# cooldown_s (9) apart. Before them the forecast must let go of the output-heavy phase (10-40 s
# here), and the decode correction learnt while six workers shared two cores (1.5-2x) must come
# down, which takes blocks of the quiet phase's finished requests; two local runs were back at
# one 31 and 35 s after the load, one later run 21 s; but a CI run on a slow stretch of this
# shared host still had decode at two replicas 90 s after it. The loop stops as soon as both are
# at one, so the allowance costs nothing when they shrink in time.
AFTER_S = 150


@pytest.fixture(scope="module")
def config(stories_path, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("planner")
    profile = tmp / "profile.json"
    cfg = {
        "model": stories_path, "mode": "disaggregated",
        "engine": {"num_threads": 1, "kv_cache_memory_bytes": 16 << 20, "emulate_device_s_per_token": 0.002,
                   "max_num_batched_tokens": 64},
        "prefill": {"replicas": 1}, "decode": {"replicas": 1},
        "router": {"port": 0, "http_port": 0, "control_port": 0},
        "heartbeat": {"interval_s": 0.5},
        # SLOs for the emulated chip: a 256-token prompt takes about 0.5 s; one decode step about
        # 3 ms + 2 ms per sequence, plus the stack's own per-token cost.
        "planner": {"mode": "sla", "profile": str(profile), "interval_s": 3, "startup_s": 6,
                    "ttft_slo_s": 1.5, "tpot_slo_s": 0.025,
                    "scale_down_window_s": 24, "cooldown_s": 9, "min_samples": 5,
                    "prefill": {"max_replicas": 3}, "decode": {"max_replicas": 3}},
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--config", str(path), "--role", "prefill",
                           "--out", str(profile), "--max-prompt", "256", "--max-batch", "16", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def drive(address: str, outcomes: list, stop: threading.Event) -> None:
    rng = random.Random(0)
    with RouterClient(address) as client, ThreadPoolExecutor(64) as pool:
        for name, seconds, rate, prompt, output in PHASES:
            end = time.monotonic() + seconds
            while time.monotonic() < end and not stop.is_set():
                ids = [rng.randrange(3, 500) for _ in range(prompt)]
                req = make_request(ids, max_tokens=output, ignore_eos=True)

                def one(req=req, phase=name):
                    try:
                        client.generate(req, timeout=120)
                        outcomes.append((phase, "ok"))
                    except Exception as e:  # every failure counts; the test requires none
                        outcomes.append((phase, repr(e)))

                pool.submit(one)
                time.sleep(rng.expovariate(rate))


def test_planner_grows_and_shrinks_the_right_pools(config):
    cfg = load_config(config)
    outcomes: list = []
    timeline = []  # (seconds since the load began, phase, {pool: target replicas}, planner json)
    with RayCluster(cfg) as cluster, RouterClient(cluster.address) as client:
        stop = threading.Event()
        loader = threading.Thread(target=drive, args=(cluster.address, outcomes, stop), daemon=True)
        t0 = time.monotonic()
        loader.start()
        bounds, acc = [], 0
        for name, seconds, *_ in PHASES:
            acc += seconds
            bounds.append((acc, name))
        while loader.is_alive() or time.monotonic() - t0 < acc + AFTER_S:
            st = client.status()
            now = time.monotonic() - t0
            phase = next((n for b, n in bounds if now < b), "after")
            timeline.append((now, phase, {p.role: p.target_replicas for p in st.pools}, st.planner))
            if phase == "after" and all(p.target_replicas == 1 for p in st.pools):
                break
            time.sleep(1.0)
        stop.set()
        loader.join(timeout=150)
    dump = os.environ.get("PDSERVE_PLANNER_TIMELINE")
    if dump:  # the planner's inputs at every poll, for reading a failure
        Path(dump).write_text(json.dumps(timeline))
    fails = [o for o in outcomes if o[1] != "ok"]
    assert not fails, f"{len(fails)} requests failed: {fails[:5]}"
    assert len(outcomes) > 150

    def peak(pool: str, phases: set[str]) -> int:
        return max(c[pool] for _, ph, c, _ in timeline if ph in phases)

    first_up = {pool: next((ph for _, ph, c, _ in timeline if c[pool] > 1), None) for pool in ("prefill", "decode")}
    report = [(round(t), ph, c) for t, ph, c, _ in timeline]
    assert first_up["prefill"] == "prompts", report  # long prompts grow the prefill pool first
    assert peak("prefill", {"prompts"}) >= 2, report
    assert first_up["decode"] == "outputs", report  # then long outputs grow the decode pool
    assert peak("decode", {"outputs", "quiet"}) >= 2, report
    last = timeline[-1][2]
    if last != {"prefill": 1, "decode": 1}:  # the whole story, which pytest's assertion report truncates
        print("timeline:", report, "\nlate decisions:", *late_decisions(timeline), sep="\n")
    assert last == {"prefill": 1, "decode": 1}, (report[-20:], late_decisions(timeline))  # and both shrink back
    decision = json.loads(timeline[-1][3])["decision"]
    assert decision["reasons"] and decision["inputs"]["predicted"], decision


def late_decisions(timeline: list) -> list:
    """The planner's decisions from the quiet phase on, in brief: what a failed shrink reads."""
    out, seen = [], None
    for t, phase, _, planner in timeline:
        decision = json.loads(planner).get("decision") if planner else None
        if not decision or phase not in ("quiet", "after") or decision.get("at_s") == seen:
            continue
        seen, inputs = decision.get("at_s"), decision["inputs"]
        out.append((round(t), decision["desired"], round(inputs["rate_planned"], 2), round(inputs["rate_decode"], 2),
                    decision["reasons"]["decode"][:80]))
    return out
