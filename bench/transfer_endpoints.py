"""The two ends of `bench/transfer.py`'s measurements, apart from what it measures: the KV pools
with the 50M benchmark model's block geometry, the raw ZeroMQ and gRPC baselines' endpoints and
sender, and the receiving process (the decode worker's checks and landing, without an engine)."""

from __future__ import annotations

import functools
import os
import queue
import random
import time

BLOCK_SHAPE = (8, 2, 16, 4, 64)  # layers, K/V, block_size, kv_heads, head_dim of the 50M model
BLOCK_SIZE = 16
RAW_GRPC_METHOD = "/bench.Raw/Push"
RAW_GRPC_LANE_METHOD = "/bench.Raw/Lane"


def frame_bytes() -> int:
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


def raw_grpc_server():
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


def raw_zmq_echo(ctx, stop) -> tuple[str, str]:
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
    """The sending side of a raw baseline (to raw_grpc_server or raw_zmq_echo in the receiver's
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
            step = step or frame_bytes()
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


def _serve_raw_only(transport: str, addr_q, ctrl_q) -> None:
    """The baseline endpoint alone, until told to stop."""
    import threading

    import zmq

    stop = threading.Event()
    server = None
    if transport == "raw_grpc":
        server, raw = raw_grpc_server()
    else:
        raw = raw_zmq_echo(zmq.Context(), stop)
    addr_q.put(({"raw": raw}, ""))
    ctrl_q.get()
    stop.set()
    if server is not None:
        server.stop(0)


class Landing:
    """What the decode worker does with a transfer, without an engine around it: a reservation of
    the pool's first blocks per request, its header checked against it, frames landed in it, and
    the seconds that took per request."""

    def __init__(self, kv) -> None:
        self.kv, self.reservations, self.timings = kv, {}, {}

    def reservation(self, h):
        from engine import KVReservation

        if h.request_id not in self.reservations:
            n = h.num_blocks
            self.reservations[h.request_id] = KVReservation(h.request_id, self.kv.layout, list(range(n)), 0, n,
                                                            prompt_of(n)[1])
        return self.reservations[h.request_id]

    def land(self, h, index, buf) -> None:  # what LLMEngine.land_kv does
        from decode_worker.kv_import import frame_offset

        off = frame_offset(h, index)
        self.kv.land(self.reservation(h).missing_block_ids[off:off + h.frames[index].num_blocks], buf)

    # The receiver's sink: frames landed as they arrive (streamed transports).
    def open(self, h) -> None:
        from decode_worker.kv_import import check_header

        self.timings[h.request_id] = {"check_and_land_s": 0.0}
        check_header(h, self.reservation(h))

    def frame(self, h, index, buf) -> None:
        t0 = time.perf_counter()
        self.land(h, index, buf)
        self.timings[h.request_id]["check_and_land_s"] += time.perf_counter() - t0

    def whole(self, item) -> None:
        """A transfer handed over whole (or its end, when streamed): checked, landed, acknowledged."""
        from decode_worker.kv_import import check_header
        from transfer import verify

        h, t0 = item.header, time.perf_counter()
        try:
            if item.error:
                raise RuntimeError(item.error)
            if not item.landed:
                verify(h, item.frames)
                check_header(h, self.reservation(h))
                for i, buf in enumerate(item.frames):
                    self.land(h, i, buf)
            item.ack(True)
        except Exception as e:
            item.ack(False, str(e))
        entry = self.timings.setdefault(h.request_id, {"check_and_land_s": 0.0})
        entry["check_and_land_s"] += time.perf_counter() - t0
        entry["streamed"] = item.landed


def receiver_main(transport: str, addr_q, ctrl_q, result_q, pool_blocks: int, curve: bool = False,
                  certs_dir: str | None = None) -> None:
    """The receiving process: a receiver per security mode ("off": no key lookup, no tags
    checked; "token": the decode worker's), each polled by a thread of its own as in the decode
    worker, and the transport's raw baseline endpoint beside them."""
    import threading

    import torch
    import zmq

    from transfer import make_receiver

    torch.set_num_threads(1)
    if transport in ("raw", "raw_grpc"):
        _serve_raw_only(transport, addr_q, ctrl_q)
        return
    landing = Landing(make_pool(pool_blocks, fill=False))
    tls = tls_credentials(certs_dir)
    rxs = {mode: make_receiver(transport, host="127.0.0.1", sink=landing, curve=curve,
                               keys=None if mode == "off" else (lambda h: transfer_key(h.request_id)),
                               server_credentials=tls.get("server_credentials")) for mode in ("off", "token")}
    stop = threading.Event()
    addrs: dict = {mode: rx.address for mode, rx in rxs.items()}
    raw_server = None
    if transport == "grpc":
        raw_server, addrs["raw"] = raw_grpc_server()
    elif transport == "zmq":
        addrs["raw"] = raw_zmq_echo(zmq.Context(), stop)
    addr_q.put((addrs, getattr(rxs["token"], "public_key", "")))

    def loop(rx) -> None:
        while not stop.is_set():
            for item in rx.poll(0.02):
                landing.whole(item)

    threads = [threading.Thread(target=loop, args=(rx,), daemon=True) for rx in rxs.values()]
    for t in threads:
        t.start()
    ctrl_q.get()  # wait for "stop"
    stop.set()
    for t in threads:
        t.join()
    result_q.put(landing.timings)
    for rx in rxs.values():
        rx.close()
    if raw_server is not None:
        raw_server.stop(0)


def turn(kinds, r: int) -> list:
    """The order of the kinds in repetition r: rotated by one each time, so that every kind takes
    every place equally often. Alternating forward and reversed order kept the middle kinds of
    three or four (token mode among them) in the middle places in every repetition."""
    k = r % len(kinds)
    return [*kinds[k:], *kinds[:k]]


def reps_for(mib: int, reps: int) -> int:
    """More repetitions for small transfers: a 1 MiB transfer takes about a millisecond, and the
    best of a few is still mostly noise. Large ones get 16: with 8, the paired ratio at 256 MiB
    (the median of 8 pairs) read 0.73 to 1.10 across three runs of the same code."""
    return max(reps, 16 if mib >= 16 else 30)

