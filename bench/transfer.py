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
import contextlib
import functools
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUT = Path(__file__).resolve().parent / "out"
SIZES_MIB = [1, 16, 256]
ONLY_ROWS = {"zmq", "grpc", "curve", "tls", "shm", "ttft"}  # what --only may name
BLOCK_SHAPE = (8, 2, 16, 4, 64)  # layers, K/V, block_size, kv_heads, head_dim of the 50M model
BLOCK_SIZE = 16

def _frame_bytes() -> int:
    """The frame size the cluster ships with (transfer.max_frame_bytes), unless overridden to compare."""
    from pdcommon.config import TransferSection

    return int(os.environ.get("PDSERVE_BENCH_FRAME_BYTES", 0)) or TransferSection().max_frame_bytes



def make_pool(num_blocks: int, fill: bool, shared: bool = False):
    """A KV pool with the 50M model's block geometry, behind the engine's own seam (KVCache);
    `shared`: in a memfd, as a prefill worker's is with transfer.shared_memory."""
    import numpy as np
    import torch

    from engine.kv_cache import KVCache
    from engine.model_meta import ModelSpec

    layers, _, bs, kv_heads, head_dim = BLOCK_SHAPE
    spec = ModelSpec("LlamaForCausalLM", 32000, 512, 1408, layers, 8, kv_heads, head_dim, 1e-6, 4096, False)
    kv = KVCache(spec, num_blocks, bs, "float32", torch.device("cpu"), shared=shared)
    if fill:
        rng = np.random.default_rng(0)
        step = 256
        for start in range(0, num_blocks, step):
            ids = list(range(start, min(start + step, num_blocks)))
            kv.land(ids, rng.standard_normal(len(ids) * kv.layout.block_nbytes // 4, dtype=np.float32).tobytes())
    return kv


@functools.lru_cache(maxsize=8)
def prompt_of(n_blocks: int) -> tuple[list[int], list[int]]:
    """A prompt of n_blocks full blocks and its block-hash chain, the same for every transfer of
    that size: in a worker both exist before the KV ships (the prefill's sequence holds the
    hashes; the decode worker's reservation was made with them when the request was admitted),
    so neither end computes them on the clock. Per request id, the receiver drew and hashed the
    prompt when the header came in: 0.5 ms of a 16 MiB transfer, 7 ms of a 256 MiB one."""
    from engine.hashing import hash_blocks

    rng = random.Random(n_blocks)
    tokens = [rng.randrange(3, 32000) for _ in range(n_blocks * BLOCK_SIZE)]
    return tokens, hash_blocks(tokens, BLOCK_SIZE)


def transfer_key(rid: str) -> bytes | None:
    """Both processes derive each transfer's key from its id; "-off-" transfers have none."""
    import hashlib

    return None if "-off-" in rid else hashlib.sha256(rid.encode()).digest()


def tls_credentials(certs_dir: str | None) -> dict:
    if not certs_dir:
        return {}
    from pdcommon.security import Certs, ClusterIdentity

    return ClusterIdentity("mtls", certs=Certs.load(certs_dir)).transfer_credentials()


RAW_GRPC_METHOD = "/bench.Raw/Push"
RAW_GRPC_LANE_METHOD = "/bench.Raw/Lane"


def _raw_grpc_server():
    """The gRPC baseline: a client-streaming call of raw byte chunks, read and dropped, then a
    one-message reply. Same chunking as the gRPC transport; no header, checks or landing. Also a
    bidirectional method answering each message with one (what a lane does for a KV of one
    chunk). Returns the started server and its address."""
    from concurrent import futures

    import grpc

    from transfer.grpc_transport import OPTIONS

    def push(chunks, context) -> bytes:
        n = sum(len(c) for c in chunks)
        return str(n).encode()

    def lane(messages, context):
        for m in messages:
            yield str(len(m)).encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(push),
                      "Lane": grpc.stream_stream_rpc_method_handler(lane)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _raw_zmq_echo(ctx, stop) -> tuple[str, str]:
    """The ZeroMQ baseline beside a transport's receiver: PULL each message, PUSH its first part
    back (a one-message acknowledgement). Returns (where to push, where to pull the acks)."""
    import threading

    import zmq

    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    a, b = pull.bind_to_random_port("tcp://127.0.0.1"), push.bind_to_random_port("tcp://127.0.0.1")

    def loop() -> None:
        while not stop.is_set():
            if pull.poll(20):
                parts = pull.recv_multipart(copy=False)
                push.send(parts[0].bytes)
        pull.close(0)
        push.close(0)

    threading.Thread(target=loop, daemon=True).start()
    return f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}"


class RawBaseline:
    """The sending side of a raw baseline (to _raw_grpc_server or _raw_zmq_echo in the receiver's
    process): the raw rows, and the transport rows' paired baseline, sent from their own loop
    between their transfers, so that each repetition's transport transfers and its raw one run
    back to back and this host's speed swings (2x, second to second) hit both, where rows
    measured minutes apart compared the host's state as much as the transports."""

    def __init__(self, transport: str, addrs: dict) -> None:
        import zmq

        self.transport = transport
        if transport == "grpc":
            import grpc

            from transfer.grpc_transport import OPTIONS

            self.channel = grpc.insecure_channel(addrs["raw"], options=OPTIONS)
            self.call = self.channel.stream_unary(RAW_GRPC_METHOD)
            self.lane_q: queue.SimpleQueue = queue.SimpleQueue()
            self.lane = self.channel.stream_stream(RAW_GRPC_LANE_METHOD)(iter(self.lane_q.get, None))
        else:
            self.zctx = zmq.Context()
            self.push, self.pull = self.zctx.socket(zmq.PUSH), self.zctx.socket(zmq.PULL)
            self.push.connect(addrs["raw"][0])
            self.pull.connect(addrs["raw"][1])

    def send(self, whole: memoryview, step: int | None = None, nonblocking: bool = False,
             lane: bool = False) -> float:
        """Seconds for one transfer of `whole`, in the transport's own pieces: gRPC chunks, each
        copied to bytes (gRPC takes only bytes), or one zero-copy ZeroMQ message per `step` bytes
        (default: a frame, transfer.max_frame_bytes), each acknowledged. As one message, 256 MiB
        moved at half the rate: ZeroMQ's receiver takes a message whole. `nonblocking`: the gRPC
        call as `.future()`, waited for through its done-callback. `lane`: the bytes as one message
        on the open bidirectional call, and its answer (gRPC only, at most one chunk)."""
        import threading

        from transfer.grpc_transport import CHUNK

        t0 = time.perf_counter()
        if self.transport == "grpc" and lane:
            self.lane_q.put(bytes(whole))
            next(self.lane)
        elif self.transport == "grpc":
            chunks = iter([bytes(whole[i:i + CHUNK]) for i in range(0, whole.nbytes, CHUNK)])
            if nonblocking:
                done = threading.Event()
                fut = self.call.future(chunks, timeout=120)
                fut.add_done_callback(lambda _: done.set())
                done.wait()
                fut.result()
            else:
                self.call(chunks, timeout=120)
        else:
            step = step or _frame_bytes()
            for i in range(0, whole.nbytes, step):
                self.push.send_multipart([b"raw", whole[i:i + step]], copy=False)
            for _ in range(0, whole.nbytes, step):
                self.pull.recv()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.transport == "grpc":
            self.lane_q.put(None)  # ends grpc's thread that drains the lane's messages
            self.channel.close()
        else:
            self.push.close(0)
            self.pull.close(0)
            self.zctx.term()


def _raw_grpc_rows(addrs: dict, kv, block_nbytes: int, sizes: list[int], reps: int) -> list[dict]:
    """Blocking calls (the baseline), non-blocking ones and, up to one chunk, messages on an open
    bidirectional call, in turns; the first of each warms up."""
    from transfer.grpc_transport import CHUNK

    raw, rows = RawBaseline("grpc", addrs), []
    for size in sizes:
        n = size * (1 << 20) // block_nbytes
        whole = memoryview(kv.frames(list(range(n)), 1 << 40)[0][0]).cast("B")
        kinds = ["raw_grpc", "raw_grpc_nonblocking", *(["raw_grpc_lane"] if whole.nbytes <= CHUNK else [])]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(_reps(size, reps) + 1):
            for k in _turn(kinds, r):
                times[k].append(raw.send(whole, nonblocking=k == "raw_grpc_nonblocking", lane=k == "raw_grpc_lane"))
        for k in kinds:
            best = min(times[k][1:])
            rows.append({"transport": k, "mib": size, "seconds": best, "gb_per_s": n * block_nbytes / best / 1e9})
            if k != "raw_grpc":
                rows[-1]["paired_vs_raw_grpc"] = statistics.median(
                    b / f for b, f in zip(times["raw_grpc"][1:], times[k][1:], strict=True))
    raw.close()
    return rows


def receiver_main(transport: str, addr_q, ctrl_q, result_q, pool_blocks: int, curve: bool = False,
                  certs_dir: str | None = None) -> None:
    import threading

    import torch
    import zmq

    from decode_worker.kv_import import check_header, frame_offset
    from engine import KVReservation
    from transfer import make_receiver, verify

    torch.set_num_threads(1)
    if transport in ("raw", "raw_grpc"):  # the baseline endpoint alone
        stop = threading.Event()
        server = None
        if transport == "raw_grpc":
            server, raw = _raw_grpc_server()
        else:
            raw = _raw_zmq_echo(zmq.Context(), stop)
        addr_q.put(({"raw": raw}, ""))
        ctrl_q.get()
        stop.set()
        if server is not None:
            server.stop(0)
        return
    kv = make_pool(pool_blocks, fill=False)
    timings: dict[str, dict] = {}
    reservations: dict[str, KVReservation] = {}

    def reservation(h) -> KVReservation:
        if h.request_id not in reservations:
            n = h.num_blocks
            reservations[h.request_id] = KVReservation(h.request_id, kv.layout, list(range(n)), 0, n,
                                                       prompt_of(n)[1])
        return reservations[h.request_id]

    def land(h, index, buf) -> None:  # what LLMEngine.land_kv does, without an engine around it
        res = reservation(h)
        off = frame_offset(h, index)
        kv.land(res.missing_block_ids[off:off + h.frames[index].num_blocks], buf)

    class Sink:  # what the decode worker does: check the header, land frames as they arrive
        def open(self, h) -> None:
            timings[h.request_id] = {"check_and_land_s": 0.0}
            check_header(h, reservation(h))

        def frame(self, h, index, buf) -> None:
            t0 = time.perf_counter()
            land(h, index, buf)
            timings[h.request_id]["check_and_land_s"] += time.perf_counter() - t0

    tls = tls_credentials(certs_dir)
    # Security off: a receiver without a key lookup (no tags checked); token: the decode worker's.
    rxs = {mode: make_receiver(transport, host="127.0.0.1", sink=Sink(), curve=curve,
                               keys=None if mode == "off" else (lambda h: transfer_key(h.request_id)),
                               server_credentials=tls.get("server_credentials")) for mode in ("off", "token")}
    stop = threading.Event()
    addrs: dict = {mode: rx.address for mode, rx in rxs.items()}
    raw_server = None
    if transport == "grpc":
        raw_server, addrs["raw"] = _raw_grpc_server()
    elif transport == "zmq":
        raw_ctx = zmq.Context()
        addrs["raw"] = _raw_zmq_echo(raw_ctx, stop)
    addr_q.put((addrs, getattr(rxs["token"], "public_key", "")))

    def loop(rx) -> None:  # one thread per receiver, as in the decode worker
        while not stop.is_set():
            for item in rx.poll(0.02):
                h = item.header
                t0 = time.perf_counter()
                try:
                    if item.error:
                        raise RuntimeError(item.error)
                    if not item.landed:
                        verify(h, item.frames)
                        check_header(h, reservation(h))
                        for i, buf in enumerate(item.frames):
                            land(h, i, buf)
                    item.ack(True)
                except Exception as e:
                    item.ack(False, str(e))
                entry = timings.setdefault(h.request_id, {"check_and_land_s": 0.0})
                entry["check_and_land_s"] += time.perf_counter() - t0
                entry["streamed"] = item.landed

    threads = [threading.Thread(target=loop, args=(rx,), daemon=True) for rx in rxs.values()]
    for t in threads:
        t.start()
    ctrl_q.get()  # wait for "stop"
    stop.set()
    for t in threads:
        t.join()
    result_q.put(timings)
    for rx in rxs.values():
        rx.close()
    if raw_server is not None:
        raw_server.stop(0)


def _turn(kinds, r: int) -> list:
    """The order of the kinds in repetition r: rotated by one each time, so that every kind takes
    every place equally often. Alternating forward and reversed order kept the middle kinds of
    three or four (token mode among them) in the middle places in every repetition."""
    k = r % len(kinds)
    return [*kinds[k:], *kinds[:k]]


def _cpu_s(child_pid: int) -> float:
    """CPU seconds (user + system, every thread) of this process and the receiver's: on two cores,
    a transfer whose ZeroMQ I/O threads already keep both cores busy pays for every byte touched."""
    import psutil

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in (os.getpid(), child_pid))


def _reps(mib: int, reps: int) -> int:
    """More repetitions for small transfers: a 1 MiB transfer takes about a millisecond, and the
    best of a few is still mostly noise. Large ones get 16: with 8, the paired ratio at 256 MiB
    (the median of 8 pairs) read 0.73 to 1.10 across three runs of the same code."""
    return max(reps, 16 if mib >= 16 else 30)


def bench_transport(transport: str, sizes: list[int], reps: int, variant: str = "plain") -> list[dict]:
    """variant: plain (security off and token, interleaved), curve (zmq), tls (grpc) or shm (zmq from
    a pool in shared memory, which the receiver maps: frames by reference), token only."""
    from engine import KVExport
    from prefill_worker.kv_export import pack_export
    from transfer import SenderLoop, TransferState, make_sender
    from transfer.grpc_transport import CHUNK

    max_blocks = max(sizes) * (1 << 20) // (4 * 8 * 2 * 16 * 4 * 64)
    # The sender's pool in the memory a prefill worker's is in: a memfd for ZeroMQ (the default
    # transfer.shared_memory puts it there, whether or not a receiver maps it), private memory
    # advised into huge pages for gRPC (engine/kv_cache.py). Where the bytes lie moves raw
    # ZeroMQ: one message of 1 MiB took 0.51 ms (median of 75) from the heap, 0.62 from a memfd
    # and 1.02 from huge pages; 16 MiB 4.9, 6.7 and 6.8 ms. This bench sent from the heap, where
    # no worker's KV lies, until the pool moved to huge pages: the ZeroMQ rows' paired_vs_raw
    # went from ~50% to ~80% at 1 MiB with the transport's own times unchanged.
    kv = make_pool(max_blocks, fill=True, shared=variant == "shm" or transport in ("zmq", "raw"))
    block_nbytes = kv.layout.block_nbytes
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
    rows = []
    if transport == "raw_grpc":
        rows = _raw_grpc_rows(addrs, kv, block_nbytes, sizes, reps)
        ctrl_q.put("stop")
        proc.join(30)
        return rows
    if transport == "raw":
        raw = RawBaseline("zmq", addrs)
        for size in sizes:
            n = size * (1 << 20) // block_nbytes
            whole = memoryview(kv.frames(list(range(n)), 1 << 40)[0][0]).cast("B")
            cpu0 = _cpu_s(proc.pid)
            # The baseline is the better of one message and one message per 16 MiB frame (ours),
            # each kind repeated as often as a transport's rows are (_reps): with 2-3 of each, its
            # best at 1 MiB ranged 1.0-2.5 GB/s from run to run on this host. The first of each
            # kind warms the connection.
            times = [raw.send(whole, whole.nbytes if r % 2 == 0 else 16 << 20)
                     for r in range(2 * _reps(size, reps) + 2)]
            best = min(times[2:])
            rows.append({"transport": "raw_zmq", "mib": size, "seconds": best,
                         "gb_per_s": n * block_nbytes / best / 1e9,
                         "cpu_ms_per_transfer": 1e3 * (_cpu_s(proc.pid) - cpu0) / (2 * _reps(size, reps) + 2)})
        raw.close()
        ctrl_q.put("stop")
        proc.join(30)
        return rows
    tls = tls_credentials(certs_dir)
    sender = make_sender(transport, curve=variant == "curve", channel_credentials=tls.get("channel_credentials"),
                         channel_options=tls.get("channel_options"))
    if variant == "shm" and not sender.share(kv.shared_fd, kv.memory()):
        raise RuntimeError("this sender cannot share its pool")
    shipper = SenderLoop(sender)
    modes = ("off", "token") if variant == "plain" else ("token",)
    export_times: dict[str, float] = {}
    cpu_ms: dict[int, float] = {}  # both processes' CPU per transfer, all modes of a size together
    totals: dict[str, float] = {}
    raw = RawBaseline(transport, addrs)
    # The raw baselines' seconds by (size, repetition): "raw" always, "raw_lane" (a message on an open
    # call) for gRPC up to one chunk.
    base_times: dict[str, dict[tuple[int, int], float]] = {"raw": {}, "raw_lane": {}}
    for size in sizes:
        n = size * (1 << 20) // block_nbytes
        whole = memoryview(kv.frames(list(range(n)), 1 << 40)[0][0]).cast("B")
        # Interleaved, in turns (_turn): every mode and the raw baselines see the same noise.
        lane = transport == "grpc" and whole.nbytes <= CHUNK
        kinds = (*modes, "raw", *(("raw_lane",) if lane else ()))
        order = [(r, m) for r in range(_reps(size, reps) + 1) for m in _turn(kinds, r)]
        cpu = 0.0
        for r, mode in order:
            if mode in base_times:
                base_times[mode][(size, r)] = raw.send(whole, lane=mode == "raw_lane")
                continue
            cpu0 = _cpu_s(proc.pid)
            rid = f"{transport}-{variant}-{mode}-{size}-{r}"
            toks, hashes = prompt_of(n)
            t0 = time.perf_counter()
            frames, counts = kv.frames(list(range(n)), _frame_bytes())
            exp = KVExport(rid, toks, kv.layout, 0, hashes, frames, counts, 0, 0.0)
            header, frames = pack_export(exp, attempt=0)
            t1 = time.perf_counter()
            # Through the prefill worker's own path: its sender thread sends and sleeps until the ack.
            handle = shipper.send(addrs[mode], header, frames, timeout_s=120, key=transfer_key(rid),
                                  peer_key=peer_key).result()
            if handle.state is not TransferState.DONE:
                raise RuntimeError(f"{rid}: {handle.error}")
            export_times[rid] = t1 - t0
            totals[rid] = time.perf_counter() - t0
            cpu += _cpu_s(proc.pid) - cpu0
        cpu_ms[size] = 1e3 * cpu / ((_reps(size, reps) + 1) * len(modes))
    raw.close()
    ctrl_q.put("stop")
    recv = result_q.get(timeout=60)
    proc.join(30)
    shipper.close()
    sender.close()
    by_reference = getattr(sender, "bytes_by_reference", 0)
    if variant == "shm" and not by_reference:
        raise RuntimeError("shm rows: no frame went by reference")
    for size, mode in ((s, m) for s in sizes for m in modes):
        n = size * (1 << 20) // block_nbytes
        rid = min((f"{transport}-{variant}-{mode}-{size}-{r}" for r in range(1, _reps(size, reps) + 1)),
                  key=lambda k: totals[k])
        t = totals[rid]
        land = recv[rid]["check_and_land_s"]
        streamed = recv[rid].get("streamed", False)
        security = {"plain": mode, "curve": "token+curve", "tls": "token+mtls", "shm": "token+shm"}[variant]
        rows.append({"transport": transport, "security": security, "mib": size, "seconds": t,
                     "gb_per_s": n * block_nbytes / t / 1e9, "streamed": streamed, "cpu_ms_per_transfer": cpu_ms[size],
                     **({"bytes_by_reference_all_sizes": by_reference} if variant == "shm" else {}),
                     # Streamed (zmq): checksums and landing overlap the wire, so the parts overlap too.
                     "breakdown_s": {"pack": export_times[rid], "check_and_land": land,
                                     "wire_and_ack": t - export_times[rid] - (0.0 if streamed else land)}})
        # This transport against the raw baselines sent beside it (RawBaseline): the median over
        # repetitions of raw seconds / this mode's seconds, i.e. the throughput ratio.
        for base, key in (("raw", "paired_vs_raw"), ("raw_lane", "paired_vs_raw_lane")):
            if (size, 1) in base_times[base]:
                rows[-1][key] = statistics.median(
                    base_times[base][(size, r)] / totals[f"{transport}-{variant}-{mode}-{size}-{r}"]
                    for r in range(1, _reps(size, reps) + 1))
        if mode == "token" and "off" in modes:
            # Each repetition's two transfers ran back to back: the median of their ratios is what
            # the machine's noise (shared, bursty) disturbs least.
            key = f"{transport}-{variant}-{{}}-{size}-{{}}"
            pairs = sorted(totals[key.format("off", r)] / totals[key.format("token", r)]
                           for r in range(1, _reps(size, reps) + 1))
            rows[-1]["paired_vs_off"] = pairs[len(pairs) // 2]
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


def ttft_split(quick: bool) -> list[dict]:
    """TTFT and the second token's wait after 128- and 2048-token prompts, 1P+1D as `pdserve up`
    runs it on one host (router in the `up` process, each worker a process of its own), the KV
    streamed and whole. The clusters are up together and take each prompt in turn (the order
    alternating), so that they see the same state of this machine, whose speed moves about 2x
    from one minute to the next. (In one process, as this ran before, the three clusters' six
    engine and event-loop threads shared one GIL, which the served product never does.)"""
    from contextlib import ExitStack

    from model_factory import build_bench_model, random_prompt

    from pdcommon.client import RouterClient, make_request

    path = build_bench_model()
    # Streamed: the prefill pool's default 512-token chunks, each one's KV shipped while the next
    # is computed (transfer.stream_min_bytes); whole: one chunk, the KV with the first token,
    # from the prefill pool's shared memory (transfer.shared_memory, the default) or over the socket.
    kinds = {"streamed": {"transfer.stream_min_bytes": 1 << 20, "transfer.shared_memory": False},
             "whole": {"transfer.stream_min_bytes": 0},
             "whole_socket": {"transfer.stream_min_bytes": 0, "transfer.shared_memory": False}}
    samples: dict[tuple[str, int], list[dict]] = {}
    with ExitStack() as stack:
        clients = {}
        for kind, overrides in kinds.items():
            address = stack.enter_context(_process_cluster({
                "model": str(path), "engine.num_threads": 2,
                "engine.max_num_batched_tokens": 4096, "engine.kv_cache_memory_bytes": 512 << 20,
                "heartbeat.interval_s": 1.0, **overrides}))
            clients[kind] = stack.enter_context(RouterClient(address))
            # Warm-up: two transfers. The first between two workers carries the prefill pool's
            # offer and goes over the socket; shared memory starts with the next. The prompts must
            # be longer than router.local_prefill_max_tokens (256 unset), or the decode worker
            # prefills them itself and nothing moves: with 64-token warm-ups, the first measured
            # 2048-token prompt was the first transfer, its second token 5-8x the ITL behind the first.
            for w in range(2):
                clients[kind].generate(make_request(random_prompt(512, seed=1 + w), max_tokens=2))
        for n in (128, 2048):
            for r in range(3 if quick else 5):
                for kind in _turn(list(kinds), r):
                    time.sleep(0.5)  # the other cluster's decode and release are over
                    request = make_request(random_prompt(n, seed=1000 * n + r), max_tokens=16, ignore_eos=True)
                    samples.setdefault((kind, n), []).append(_second_token(clients[kind], request))
    rows = []
    for (kind, n), runs in samples.items():
        best = min(runs, key=lambda s: s["ttft"])
        rows.append({"kv": kind, "prompt_len": n, **best, "runs": runs,
                     "second_gap_over_itl_median": statistics.median(s["second_token_gap"] / s["itl_p50"]
                                                                     for s in runs)})
    return rows


@contextlib.contextmanager
def _process_cluster(overrides: dict):
    """`pdserve up --launcher process` with these config values, on free ports; bench/serve.py's
    Server starts it, waits for it and stops its whole process group. Yields the router's address."""
    import tempfile

    import yaml
    from serve import Server

    from pdcommon.config import load_config
    from pdserve.launch.ports import free_ports

    names = ("port", "http_port", "control_port", "token_port")
    ports = dict(zip(names, free_ports("127.0.0.1", len(names)), strict=True))
    cfg = load_config(None, **{f"router.{k}": v for k, v in ports.items()}, **overrides)
    with tempfile.TemporaryDirectory(prefix="pdbench-") as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        with Server(f"{sys.executable} -m pdserve.cli up --launcher process --config {path}",
                    f"http://127.0.0.1:{ports['http_port']}"):
            yield f"127.0.0.1:{ports['port']}"


def _second_token(client, request) -> dict:
    arrivals, t, usage = _stream_times(client, request)
    gaps = sorted(b - a for a, b in zip(arrivals[1:], arrivals[2:], strict=False))
    itl = gaps[len(gaps) // 2]  # tokens 3.. : decode in its steady state
    return {"queue": t["queue"], "prefill": t["prefill"],
            "first_token": max(t["ttft"] - t["queue"] - t["prefill"], 0.0), "ttft": t["ttft"],
            "kv_transfer": t["kv_transfer"], "kv_bytes": usage["kv_transfer_bytes"],
            # Issue 10: the KV's trip must not hold up the second token by more than two
            # inter-token latencies, as the client sees them.
            "client_ttft": arrivals[0], "second_token_gap": arrivals[1] - arrivals[0],
            "itl_p50": itl, "second_within_ttft_plus_2itl": arrivals[1] - arrivals[0] <= 2 * itl}


def _stream_times(client, request) -> tuple[list[float], dict, dict]:
    """Arrival time of every token (from the request's start, as the client sees it), with the
    router's timings and usage from the last message."""
    from pdcommon.client import fields

    arrivals: list[float] = []
    t0 = time.perf_counter()
    timings: dict = {}
    usage: dict = {}
    for msg in client.stream(request, timeout=300):
        now = time.perf_counter() - t0
        arrivals += [now] * len(msg.token_ids)
        if msg.finish_reason:
            timings, usage = fields(msg.timings), fields(msg.usage)
    return arrivals, timings, usage


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
    raw = {r["mib"]: r["gb_per_s"] for r in result["throughput"] if r["transport"] == "raw_zmq"}
    raw_grpc = {r["mib"]: r["gb_per_s"] for r in result["throughput"] if r["transport"] == "raw_grpc"}
    raw_lane = {r["mib"]: r["gb_per_s"] for r in result["throughput"] if r["transport"] == "raw_grpc_lane"}
    result["security"] = security_summary(result["throughput"])
    for r in result["throughput"]:
        r["vs_raw_zmq"] = r["gb_per_s"] / raw[r["mib"]]
        if r["transport"] in ("grpc", "raw_grpc_nonblocking", "raw_grpc_lane"):  # a raw gRPC stream, same bytes
            r["vs_raw_grpc"] = r["gb_per_s"] / raw_grpc[r["mib"]]
        if r["transport"] == "grpc" and r["mib"] in raw_lane:  # and what the transport does for one chunk
            r["vs_raw_grpc_lane"] = r["gb_per_s"] / raw_lane[r["mib"]]
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
    for row in result["security"]:
        print(f"security {row['transport']:4s} {row['mib']:4d} MiB: token/off {row['token_vs_off']:.3f} (median of "
              f"pairs; best/best {row['best_token_vs_best_off']:.3f})"
              + (f", {row['encrypted']}/token {row['encrypted_vs_token']:.3f}" if "encrypted" in row else ""))
    result["ttft"] = ttft_split(args.quick) if not only or "ttft" in only else []
    for r in result["ttft"]:
        print(f"[{r['kv']:8s}] TTFT {r['prompt_len']:5d} tokens: {r['ttft'] * 1e3:7.1f} ms = queue "
              f"{r['queue'] * 1e3:.1f} + prefill "
              f"{r['prefill'] * 1e3:.1f} + first token {r['first_token'] * 1e3:.1f} ms; KV transfer "
              f"{r['kv_transfer'] * 1e3:.1f} ms for {r['kv_bytes'] / 2**20:.1f} MiB (after the first token, or "
              f"its last part); second "
              f"token {r['second_token_gap'] * 1e3:.1f} ms after the first, ITL p50 {r['itl_p50'] * 1e3:.1f} ms "
              f"(within 2 ITL: {r['second_within_ttft_plus_2itl']}; gap / ITL, median of runs "
              f"{r['second_gap_over_itl_median']:.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")  # every row ran with these
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
