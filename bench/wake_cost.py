"""What one token message per step costs the engine thread, by how the receiver waits (issue #10,
target 4: the profile behind what `bench/overhead.py` calls "the stack adds").

The engine alone steps one stream of stories260K in this process (one thread, as a worker runs
it) and after every step sends one small message to a receiver in another process:

- `none`: no message (the engine's own step);
- `token_pusher`: the decode worker's own path, `TokenPusher` to a `TokenInbox` read from an
  asyncio loop's selector, as the router reads it: the receiver sleeps between tokens;
- `tcp_sleeping`: one `send` on a plain TCP socket (loopback) to a receiver asleep in its event
  loop, what a token path without ZeroMQ's I/O threads would do;
- `unix_sleeping`: the same over a Unix socket: the least a sender can do that must wake a
  sleeping receiver;
- `unix_spinning`: the same socket, its receiver spinning on non-blocking reads, so the send wakes
  nobody. A bound, not a design: it burns the receiver's core.

Per mode: the median time of the step, of the send, and of the loop's period (step to step).
The modes alternate, ROUNDS times; receivers and the pusher's I/O thread run as serving threads
(slice and nice value) and the engine as a worker's engine thread. What separates
`unix_sleeping` from `unix_spinning` is the cost of waking a thread that sleeps on another core,
paid on the sender's core, in the send and in the next step.

Writes bench/out/wake_cost.json. Run: .venv/bin/python bench/wake_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from overhead import write_json  # noqa: E402  (bench/ is this script's own folder)

OUT = Path(__file__).resolve().parent / "out"
MODEL = ROOT.parent / "shared" / "models" / "stories260K"
PROMPT = "Once upon a time there was a little girl named Lily"
MODES = ("none", "token_pusher", "tcp_sleeping", "unix_sleeping", "unix_spinning")
ROUNDS, TOKENS = 4, 300
KEY = b"k" * 32


def as_a_serving_thread() -> None:
    """The calling thread's slice and nice value as a router's or worker's serving threads have
    them (pdcommon/priority.py, the shipped process section); threads it starts inherit them."""
    from pdcommon.config import ProcessSection
    from pdcommon.priority import lower_thread_priority, set_thread_slice

    section = ProcessSection()
    set_thread_slice(section.serving_slice_us)
    lower_thread_priority(section.io_nice)


def inbox_main(addr_q) -> None:
    """The router's side of the token path: a TokenInbox on an event loop."""
    from pdcommon.token_stream import TokenInbox

    as_a_serving_thread()

    async def run() -> None:
        inbox = TokenInbox("127.0.0.1", 0)
        inbox.start()
        q = inbox.open("bench", 0, KEY)
        addr_q.put(f"tcp://127.0.0.1:{inbox.port}")
        while True:
            await q.get()

    asyncio.run(run())


def unix_main(path: str, spin: bool, addr_q) -> None:
    as_a_serving_thread()
    srv = socket.socket(socket.AF_UNIX if path else socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(path or ("127.0.0.1", 0))
    srv.listen()
    addr_q.put(srv.getsockname())
    conn, _ = srv.accept()
    conn.setblocking(False)

    def drain() -> None:
        try:
            while conn.recv(1 << 16):
                pass
        except BlockingIOError:
            pass

    if spin:
        while True:
            drain()

    async def run() -> None:
        asyncio.get_running_loop().add_reader(conn.fileno(), drain)
        await asyncio.Event().wait()

    asyncio.run(run())


def make_sender(mode: str, tmp: str):
    """(send(), receiver process) for a mode."""
    ctx = mp.get_context("spawn")
    addr_q = ctx.Queue()
    if mode == "none":
        return (lambda: None), None
    if mode == "token_pusher":
        from pdcommon.token_stream import TokenChunk, TokenPusher, pack

        proc = ctx.Process(target=inbox_main, args=(addr_q,), daemon=True)
        proc.start()
        # Built on a serving thread, as the decode worker builds it: ZeroMQ's I/O thread, started
        # there, inherits that thread's slice and nice value; the engine (this thread) keeps its own.
        made: list[TokenPusher] = []
        maker = threading.Thread(target=lambda: (as_a_serving_thread(), made.append(TokenPusher())))
        maker.start()
        maker.join()
        endpoint, pusher = addr_q.get(timeout=60), made[0]
        frames = pack("bench", 0, KEY, TokenChunk(0, [42], " word", [-0.5]))
        return (lambda: pusher.send(endpoint, frames)), proc
    path = "" if mode.startswith("tcp") else os.path.join(tmp, f"{mode}.sock")
    proc = ctx.Process(target=unix_main, args=(path, mode == "unix_spinning", addr_q), daemon=True)
    proc.start()
    sock = socket.socket(socket.AF_UNIX if path else socket.AF_INET, socket.SOCK_STREAM)
    if not path:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.connect(addr_q.get(timeout=60))
    msg = b"x" * 96
    return (lambda: sock.send(msg)), proc


def one_round(eng, ids, params, send, rid: str) -> dict:
    eng.add_request(rid, ids, params)
    steps, sends, periods, last = [], [], [], None
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        t1 = time.perf_counter()
        send()
        t2 = time.perf_counter()
        steps.append(t1 - t0)
        sends.append(t2 - t1)
        if last is not None:
            periods.append(t0 - last)
        last = t0
    # The first steps are the prefill and the stream's start.
    return {"step_s": statistics.median(steps[2:]), "send_s": statistics.median(sends[2:]),
            "period_s": statistics.median(periods[2:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(OUT / "wake_cost.json"))
    args = ap.parse_args()
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=str(MODEL), num_threads=1))
    ids = eng.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="pdbench-wake-") as tmp:
        senders = {m: make_sender(m, tmp) for m in MODES}
        time.sleep(0.5)  # connections up before anything is timed
        for m in MODES:  # warm-up
            one_round(eng, ids, params, senders[m][0], f"warm-{m}")
        for r in range(ROUNDS):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for m in order:
                rounds[m].append(one_round(eng, ids, params, senders[m][0], f"{m}-{r}"))
        for _, proc in senders.values():
            if proc is not None:
                proc.kill()
    result: dict = {"rounds": rounds, "modes": {}}
    base = statistics.median(x["period_s"] for x in rounds["none"])
    for m in MODES:
        row = {k: statistics.median(x[k] for x in rounds[m]) for k in ("step_s", "send_s", "period_s")}
        row["period_vs_none"] = row["period_s"] / base
        result["modes"][m] = row
        print(f"{m:14s} step {row['step_s'] * 1e6:6.0f} us, send {row['send_s'] * 1e6:5.0f} us, "
              f"period {row['period_s'] * 1e6:6.0f} us ({100 * (row['period_vs_none'] - 1):+.0f}% on the engine's own)")
    return write_json(result, Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
