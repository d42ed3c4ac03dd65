"""KV transfer throughput pool -> pool between two processes, and the TTFT split.

Part 1: for 1, 16 and 256 MiB of KV blocks (the 50M benchmark model's block geometry), each
transport moves blocks from one process's block-major pool into another's, through the real
code path: pack (frame runs; xxh3 per frame), wire, checks (checksums, geometry, hash chain)
and landing in the reserved blocks, acknowledged back to the sender. Over ZeroMQ the frames
stream: each is hashed just before it leaves and checked and landed as it arrives. Baseline in the same run:
raw ZeroMQ PUSH/PULL of the same bytes with a one-message acknowledgement.

Security (#9): every transfer of the zmq and grpc rows runs twice, interleaved, through the same
sockets: with security off (no transfer key: no tags made or checked) and in token mode (a
one-time key per transfer: HMAC-SHA256 tags over the header and every frame's digest, checked
before landing). `token_vs_off` is their throughput ratio in this run (target >= 0.95): the median
over repetitions of each back-to-back pair's ratio. The costs of
encryption are reported, not targeted: ZeroMQ with CURVE and the gRPC transport over mutual TLS,
each against its own plain run.

The sender's pool lies where a prefill worker's does (a memfd for ZeroMQ, transfer.shared_memory;
private memory in huge pages for gRPC), and raw ZeroMQ's speed depends on it (bench_transport).

Same host (`shm` rows): the sender's pool in shared memory, as a prefill worker's is with
transfer.shared_memory; the receiver maps it on the first transfer (bytes, not timed) and then
takes every frame by reference (transfer/shared_memory.py), checksums and tags as on the wire.

Baselines in the same run: raw ZeroMQ (above) and a raw gRPC client stream of the same bytes in
the gRPC transport's 4 MiB chunks, read and dropped (`vs_raw_grpc` for the gRPC rows). Those rows
run first, minutes before the transports' own, and this host's speed swings 2x from second to
second, so each transport row also has `paired_vs_raw`: a raw transfer (its transport's baseline,
one ZeroMQ message or the gRPC chunk stream, to an endpoint in the receiver's process) runs beside
each repetition, in alternating order, and the ratio is the median of the pairs' throughput.

The raw gRPC stream is a blocking call, which pumps its own completion queue. A sender that has
many transfers open at once cannot block on one: `raw_grpc_nonblocking` makes the same call
as `.future()` and waits on its done-callback, as the gRPC transport's sender thread does, and
its `paired_vs_raw_grpc` (against blocking calls alternating with it) is what gRPC's own
non-blocking path costs before the transport does anything (about 0.2 ms a call here).
A KV of up to 16 MiB goes on a lane, a bidirectional call the sender keeps open to the receiver
(transfer/grpc_lane.py); one of one 4 MiB chunk or less goes there as one message, so up to that
size there is also `raw_grpc_lane`, the same bytes as one message on an open bidirectional call,
answered by one message: the gRPC rows' `vs_raw_grpc_lane` and `paired_vs_raw_lane` compare with
it, the cheapest way gRPC offers to move the bytes, without a call's own cost.

Part 2: TTFT split into queue / prefill / first-token delivery, plus the KV transfer time, for
128- and 2048-token prompts through a real router + prefill + decode on the 50M model.

Writes bench/out/transfer.json. Run: .venv/bin/python bench/transfer.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transfer_endpoints import (  # noqa: E402  (bench/ and the repository on the path first)
    RawBaseline,
    frame_bytes,
    make_pool,
    prompt_of,
    receiver_main,
    reps_for,
    tls_credentials,
    transfer_key,
    turn,
)
from transfer_ttft import ttft_split  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SIZES_MIB = [1, 16, 256]
ONLY_ROWS = {"zmq", "grpc", "curve", "tls", "shm", "ttft"}  # what --only may name


def _cpu_s(child_pid: int) -> float:
    """CPU seconds (user + system, every thread) of this process and the receiver's: on two cores,
    a transfer whose ZeroMQ I/O threads already keep both cores busy pays for every byte touched."""
    import psutil

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in (os.getpid(), child_pid))


@dataclass
class Receiver:
    """The receiving process (transfer_endpoints.receiver_main) and its queues."""
    proc: mp.process.BaseProcess
    ctrl_q: object
    result_q: object
    addrs: dict
    peer_key: str
    certs_dir: str | None

    def stop(self) -> dict | None:
        """Stop it; the transfers' timings where it measured any (a transport's receivers, each
        security mode's, report them; a raw baseline's endpoint alone reports nothing)."""
        self.ctrl_q.put("stop")
        timings = self.result_q.get(timeout=60) if "token" in self.addrs else None
        self.proc.join(30)
        return timings


def _start_receiver(transport: str, variant: str, max_blocks: int) -> Receiver:
    ctx = mp.get_context("spawn")
    addr_q, ctrl_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    certs_dir = None
    if variant == "tls":
        import tempfile

        from pdserve.certs import make_certs

        certs_dir = str(make_certs(Path(tempfile.mkdtemp(prefix="pdbench-certs-"))))
    proc = ctx.Process(target=receiver_main, daemon=True,
                       args=(transport, addr_q, ctrl_q, result_q, max_blocks, variant == "curve", certs_dir))
    proc.start()
    addrs, peer_key = addr_q.get(timeout=60)
    return Receiver(proc, ctrl_q, result_q, addrs, peer_key, certs_dir)


def _whole(kv, size_mib: int) -> tuple[int, memoryview]:
    """The first size_mib MiB of the pool's blocks: their count and their bytes as one buffer."""
    n = size_mib * (1 << 20) // kv.layout.block_nbytes
    return n, memoryview(kv.frames(list(range(n)), 1 << 40)[0][0]).cast("B")


def _raw_grpc_rows(rx: Receiver, kv, sizes: list[int], reps: int) -> list[dict]:
    """Blocking calls (the baseline), non-blocking ones and, up to one chunk, messages on an open
    bidirectional call, in turns; the first of each warms up."""
    from transfer.grpc_transport import CHUNK

    raw, rows, block_nbytes = RawBaseline("grpc", rx.addrs), [], kv.layout.block_nbytes
    for size in sizes:
        n, whole = _whole(kv, size)
        kinds = ["raw_grpc", "raw_grpc_nonblocking", *(["raw_grpc_lane"] if whole.nbytes <= CHUNK else [])]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(reps_for(size, reps) + 1):
            for k in turn(kinds, r):
                times[k].append(raw.send(whole, nonblocking=k == "raw_grpc_nonblocking", lane=k == "raw_grpc_lane"))
        for k in kinds:
            best = min(times[k][1:])
            rows.append({"transport": k, "mib": size, "seconds": best, "gb_per_s": n * block_nbytes / best / 1e9})
            if k != "raw_grpc":
                rows[-1]["paired_vs_raw_grpc"] = statistics.median(
                    b / f for b, f in zip(times["raw_grpc"][1:], times[k][1:], strict=True))
    raw.close()
    return rows


def _raw_zmq_rows(rx: Receiver, kv, sizes: list[int], reps: int) -> list[dict]:
    raw, rows = RawBaseline("zmq", rx.addrs), []
    for size in sizes:
        n, whole = _whole(kv, size)
        cpu0 = _cpu_s(rx.proc.pid)
        # The baseline is the better of one message and one message per 16 MiB frame (ours),
        # each kind repeated as often as a transport's rows are (reps_for): with 2-3 of each, its
        # best at 1 MiB ranged 1.0-2.5 GB/s from run to run on this host. The first of each
        # kind warms the connection.
        times = [raw.send(whole, whole.nbytes if r % 2 == 0 else 16 << 20)
                 for r in range(2 * reps_for(size, reps) + 2)]
        best = min(times[2:])
        rows.append({"transport": "raw_zmq", "mib": size, "seconds": best,
                     "gb_per_s": n * kv.layout.block_nbytes / best / 1e9,
                     "cpu_ms_per_transfer": 1e3 * (_cpu_s(rx.proc.pid) - cpu0) / (2 * reps_for(size, reps) + 2)})
    raw.close()
    return rows


@dataclass
class Runs:
    """A transport's timed transfers, by id (`transport-variant-mode-size-repetition`), and the raw
    baselines' seconds by (size, repetition): "raw" always, "raw_lane" (a message on an open
    call) for gRPC up to one chunk."""
    export_s: dict[str, float] = field(default_factory=dict)
    total_s: dict[str, float] = field(default_factory=dict)
    cpu_ms: dict[int, float] = field(default_factory=dict)  # both processes' CPU per transfer, by size
    base_s: dict[str, dict[tuple[int, int], float]] = field(default_factory=lambda: {"raw": {}, "raw_lane": {}})


def _one_transfer(shipper, kv, rx: Receiver, rid: str, n: int, mode: str) -> tuple[float, float]:
    """Pack and ship one KV of n blocks through the prefill worker's own path (its sender thread
    sends and sleeps until the ack). Returns (packing seconds, total seconds)."""
    from engine import KVExport
    from prefill_worker.kv_export import pack_export
    from transfer import TransferState

    toks, hashes = prompt_of(n)
    t0 = time.perf_counter()
    frames, counts = kv.frames(list(range(n)), frame_bytes())
    header, frames = pack_export(KVExport(rid, toks, kv.layout, 0, hashes, frames, counts, 0, 0.0), attempt=0)
    t1 = time.perf_counter()
    handle = shipper.send(rx.addrs[mode], header, frames, timeout_s=120, key=transfer_key(rid),
                          peer_key=rx.peer_key).result()
    if handle.state is not TransferState.DONE:
        raise RuntimeError(f"{rid}: {handle.error}")
    return t1 - t0, time.perf_counter() - t0


def _run_transport(shipper, kv, rx: Receiver, transport: str, variant: str, modes: tuple[str, ...],
                   sizes: list[int], reps: int) -> Runs:
    """Every mode and the raw baselines interleaved, in turns (turn), so they see the same noise."""
    from transfer.grpc_transport import CHUNK

    runs, raw = Runs(), RawBaseline(transport, rx.addrs)
    for size in sizes:
        n, whole = _whole(kv, size)
        lane = transport == "grpc" and whole.nbytes <= CHUNK
        kinds = (*modes, "raw", *(("raw_lane",) if lane else ()))
        cpu = 0.0
        for r, mode in [(rep, m) for rep in range(reps_for(size, reps) + 1) for m in turn(kinds, rep)]:
            if mode in runs.base_s:
                runs.base_s[mode][(size, r)] = raw.send(whole, lane=mode == "raw_lane")
                continue
            cpu0 = _cpu_s(rx.proc.pid)
            rid = f"{transport}-{variant}-{mode}-{size}-{r}"
            runs.export_s[rid], runs.total_s[rid] = _one_transfer(shipper, kv, rx, rid, n, mode)
            cpu += _cpu_s(rx.proc.pid) - cpu0
        runs.cpu_ms[size] = 1e3 * cpu / ((reps_for(size, reps) + 1) * len(modes))
    raw.close()
    return runs


def _transport_row(runs: Runs, recv: dict, block_nbytes: int, transport: str, variant: str, mode: str,
                   size: int, reps: int) -> dict:
    """One mode and size: its best transfer, with the medians of its pairs against the raw
    baselines (and, for token mode, against security off) sent beside it."""
    n = size * (1 << 20) // block_nbytes
    rid_of = f"{transport}-{variant}-{{}}-{size}-{{}}".format
    measured = range(1, reps_for(size, reps) + 1)
    rid = min((rid_of(mode, r) for r in measured), key=lambda k: runs.total_s[k])
    t, land = runs.total_s[rid], recv[rid]["check_and_land_s"]
    streamed = recv[rid].get("streamed", False)
    security = {"plain": mode, "curve": "token+curve", "tls": "token+mtls", "shm": "token+shm"}[variant]
    row = {"transport": transport, "security": security, "mib": size, "seconds": t,
           "gb_per_s": n * block_nbytes / t / 1e9, "streamed": streamed, "cpu_ms_per_transfer": runs.cpu_ms[size],
           # Streamed (zmq): checksums and landing overlap the wire, so the parts overlap too.
           "breakdown_s": {"pack": runs.export_s[rid], "check_and_land": land,
                           "wire_and_ack": t - runs.export_s[rid] - (0.0 if streamed else land)}}
    # Against the raw baselines sent beside it (RawBaseline): the median over repetitions of raw
    # seconds / this mode's seconds, i.e. the throughput ratio.
    for base, key in (("raw", "paired_vs_raw"), ("raw_lane", "paired_vs_raw_lane")):
        if (size, 1) in runs.base_s[base]:
            row[key] = statistics.median(runs.base_s[base][(size, r)] / runs.total_s[rid_of(mode, r)]
                                         for r in measured)
    if mode == "token" and rid_of("off", 1) in runs.total_s:
        # Each repetition's two transfers ran back to back: the median of their ratios is what
        # the machine's noise (shared, bursty) disturbs least.
        pairs = sorted(runs.total_s[rid_of("off", r)] / runs.total_s[rid_of("token", r)] for r in measured)
        row["paired_vs_off"] = pairs[len(pairs) // 2]
    return row


def bench_transport(transport: str, sizes: list[int], reps: int, variant: str = "plain") -> list[dict]:
    """variant: plain (security off and token, interleaved), curve (zmq), tls (grpc) or shm (zmq from
    a pool in shared memory, which the receiver maps: frames by reference), token only."""
    from transfer import SenderLoop, make_sender

    max_blocks = max(sizes) * (1 << 20) // (4 * 8 * 2 * 16 * 4 * 64)
    # The sender's pool in the memory a prefill worker's is in: a memfd for ZeroMQ (the default
    # transfer.shared_memory puts it there, whether or not a receiver maps it), private memory
    # advised into huge pages for gRPC (engine/kv_cache.py). Where the bytes lie moves raw
    # ZeroMQ: one message of 1 MiB took 0.51 ms (median of 75) from the heap, 0.62 from a memfd
    # and 1.02 from huge pages; 16 MiB 4.9, 6.7 and 6.8 ms. This bench sent from the heap, where
    # no worker's KV lies, until the pool moved to huge pages: the ZeroMQ rows' paired_vs_raw
    # went from ~50% to ~80% at 1 MiB with the transport's own times unchanged.
    kv = make_pool(max_blocks, fill=True, shared=variant == "shm" or transport in ("zmq", "raw"))
    rx = _start_receiver(transport, variant, max_blocks)
    if transport in ("raw", "raw_grpc"):
        rows = (_raw_grpc_rows if transport == "raw_grpc" else _raw_zmq_rows)(rx, kv, sizes, reps)
        rx.stop()
        return rows
    tls = tls_credentials(rx.certs_dir)
    sender = make_sender(transport, curve=variant == "curve", channel_credentials=tls.get("channel_credentials"),
                         channel_options=tls.get("channel_options"))
    if variant == "shm" and not sender.share(kv.shared_fd, kv.memory()):
        raise RuntimeError("this sender cannot share its pool")
    shipper = SenderLoop(sender)
    modes = ("off", "token") if variant == "plain" else ("token",)
    runs = _run_transport(shipper, kv, rx, transport, variant, modes, sizes, reps)
    recv = rx.stop()
    shipper.close()
    sender.close()
    by_reference = getattr(sender, "bytes_by_reference", 0)
    if variant == "shm" and not by_reference:
        raise RuntimeError("shm rows: no frame went by reference")
    rows = [_transport_row(runs, recv, kv.layout.block_nbytes, transport, variant, mode, size, reps)
            for size in sizes for mode in modes]
    if variant == "shm":
        for row in rows:
            row["bytes_by_reference_all_sizes"] = by_reference
    return rows


def security_summary(rows: list[dict]) -> list[dict]:
    """Per transport and size: token mode against security off (same run, interleaved), and the
    encrypted variant against token mode."""
    by = {(r["transport"], r.get("security"), r["mib"]): r["gb_per_s"] for r in rows}
    paired = {(r["transport"], r["mib"]): r["paired_vs_off"] for r in rows if "paired_vs_off" in r}
    out = []
    for (transport, security, mib), gbps in by.items():
        if security != "off":
            continue
        row = {"transport": transport, "mib": mib, "token_vs_off": paired[(transport, mib)],
               "best_token_vs_best_off": by[(transport, "token", mib)] / gbps}
        enc = {"zmq": "token+curve", "grpc": "token+mtls"}[transport]
        if (transport, enc, mib) in by:
            row.update(encrypted=enc, encrypted_vs_token=by[(transport, enc, mib)] / by[(transport, "token", mib)])
        out.append(row)
    return out


def reexec_as_a_worker(args) -> None:
    """Start over in the malloc environment pdserve's engine processes run in (process_env):
    glibc reads it only at process start, and the spawned receiver inherits it. Every row runs
    in it, the raw baselines too. Without it each 4 MiB message ZeroMQ receives is a fresh mmap,
    page-faulted in and returned (and so is every gathered frame), where a worker reuses its heap:
    the bench measured a transport slower than the one that serves."""
    from pdcommon.process_env import engine_process_env, missing_from

    want = engine_process_env(1)
    if args.plain_malloc or not missing_from(os.environ, want):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": want["GLIBC_TUNABLES"]})


def _add_ratios(rows: list[dict]) -> None:
    """Each row against the raw baselines of this run: raw ZeroMQ, and for gRPC a raw gRPC stream
    of the same bytes and (up to one chunk) a raw lane message."""
    raw, raw_grpc, raw_lane = ({r["mib"]: r["gb_per_s"] for r in rows if r["transport"] == name}
                               for name in ("raw_zmq", "raw_grpc", "raw_grpc_lane"))
    for r in rows:
        r["vs_raw_zmq"] = r["gb_per_s"] / raw[r["mib"]]
        if r["transport"] in ("grpc", "raw_grpc_nonblocking", "raw_grpc_lane"):  # a raw gRPC stream, same bytes
            r["vs_raw_grpc"] = r["gb_per_s"] / raw_grpc[r["mib"]]
        if r["transport"] == "grpc" and r["mib"] in raw_lane:  # and what the transport does for one chunk
            r["vs_raw_grpc_lane"] = r["gb_per_s"] / raw_lane[r["mib"]]


def _print_throughput(rows: list[dict], security: list[dict]) -> None:
    for r in rows:
        print(f"{r['transport']:20s} {r.get('security', ''):11s} {r['mib']:4d} MiB: {r['gb_per_s']:6.2f} GB/s  "
              f"({100 * r['vs_raw_zmq']:5.1f}% of raw zmq"
              + (f", {100 * r['vs_raw_grpc']:5.1f}% of raw grpc)" if "vs_raw_grpc" in r else ")")
              + (f"  paired with its raw baseline: {100 * r['paired_vs_raw']:5.1f}%" if "paired_vs_raw" in r else "")
              + (f"  paired with blocking calls: {100 * r['paired_vs_raw_grpc']:5.1f}%"
                 if "paired_vs_raw_grpc" in r else "")
              + (f"  paired with a raw lane: {100 * r['paired_vs_raw_lane']:5.1f}%"
                 if "paired_vs_raw_lane" in r else "")
              + (f"  CPU {r['cpu_ms_per_transfer']:.1f} ms" if "cpu_ms_per_transfer" in r else "")
              + (f"  pack {r['breakdown_s']['pack'] * 1e3:.1f} ms, wire+ack "
                 f"{r['breakdown_s']['wire_and_ack'] * 1e3:.1f} ms, check+land "
                 f"{r['breakdown_s']['check_and_land'] * 1e3:.1f} ms" if "breakdown_s" in r else ""))
    for row in security:
        print(f"security {row['transport']:4s} {row['mib']:4d} MiB: token/off {row['token_vs_off']:.3f} (median of "
              f"pairs; best/best {row['best_token_vs_best_off']:.3f})"
              + (f", {row['encrypted']}/token {row['encrypted_vs_token']:.3f}" if "encrypted" in row else ""))


def _print_ttft(rows: list[dict]) -> None:
    for r in rows:
        print(f"[{r['kv']:8s}] TTFT {r['prompt_len']:5d} tokens: {r['ttft'] * 1e3:7.1f} ms = queue "
              f"{r['queue'] * 1e3:.1f} + prefill "
              f"{r['prefill'] * 1e3:.1f} + first token {r['first_token'] * 1e3:.1f} ms; KV transfer "
              f"{r['kv_transfer'] * 1e3:.1f} ms for {r['kv_bytes'] / 2**20:.1f} MiB (after the first token, or "
              f"its last part); second "
              f"token {r['second_token_gap'] * 1e3:.1f} ms after the first, ITL p50 {r['itl_p50'] * 1e3:.1f} ms "
              f"(within 2 ITL: {r['second_within_ttft_plus_2itl']}; gap / ITL, median of runs "
              f"{r['second_gap_over_itl_median']:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plain-malloc", action="store_true",
                    help="keep this shell's malloc settings instead of the workers' (GLIBC_TUNABLES)")
    ap.add_argument("--out", default=str(OUT / "transfer.json"))
    ap.add_argument("--only", default="", help="comma-separated rows to run, of zmq, grpc, curve, tls, ttft "
                    "(the raw baselines always run): one transport's change measured in a minute")
    args = ap.parse_args()
    reexec_as_a_worker(args)
    only = set(filter(None, args.only.split(",")))
    if only - ONLY_ROWS:
        ap.error(f"--only: unknown rows {sorted(only - ONLY_ROWS)}; choose from {sorted(ONLY_ROWS)}")
    reps = 2 if args.quick else 3
    result: dict = {"throughput": [], "ttft": []}
    for transport, variant, name in (("raw", "plain", ""), ("raw_grpc", "plain", ""), ("zmq", "plain", "zmq"),
                                     ("grpc", "plain", "grpc"), ("zmq", "curve", "curve"), ("grpc", "tls", "tls"),
                                     ("zmq", "shm", "shm")):
        if not only or not name or name in only:
            result["throughput"] += bench_transport(transport, SIZES_MIB, reps, variant)
    _add_ratios(result["throughput"])
    result["security"] = security_summary(result["throughput"])
    _print_throughput(result["throughput"], result["security"])
    result["ttft"] = ttft_split(args.quick) if not only or "ttft" in only else []
    _print_ttft(result["ttft"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")  # every row ran with these
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
