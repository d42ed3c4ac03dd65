"""The gRPC transport's receiving end: the generic Push and Lane methods, each message's tags
checked before its bytes are read, frames checked and landed as they arrive; the message format is
transfer/grpc_transport.py's."""

from __future__ import annotations

import hmac
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from transfer.base import KVReceiver, KVSink, ReceivedKV, drain
from transfer.grpc_lane import MAX_LANES, LaneServer, ack_message
from transfer.grpc_transport import (
    FRAME_PREFIX,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_TAG_BYTES,
    OPTIONS,
    SERVICE,
    messages_after_opening,
    parse_opening,
    server_keepalive,
)
from transfer.wire import KeyLookup, KVHeader, TransferError, authorize, frame_tag, verify_frame, verify_frame_size


class GrpcReceiver(KVReceiver):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 ack_timeout_s: float = 60.0, keys: KeyLookup | None = None,
                 server_credentials: grpc.ServerCredentials | None = None, sink: KVSink | None = None,
                 max_lanes: int = MAX_LANES, keepalive_s: float = KEEPALIVE_S,
                 keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S) -> None:
        """With a `sink`, each frame is checked and handed over as it arrives, from the chunk
        gRPC already holds (no reassembly copy when a frame fits one chunk). A sender that stops
        answering (frozen, its host down, the cable out: no FIN reaches this side) loses its
        calls and lanes within `keepalive_s` + `keepalive_timeout_s`."""
        self._queue: queue.Queue[ReceivedKV] = queue.Queue()
        self.keys, self.sink = keys, sink
        self.ack_timeout_s = ack_timeout_s
        self.lanes = LaneServer(self._receive, max_lanes)
        # Each open lane holds a thread: the calls per transfer keep 8 of their own.
        # Pings on quiet connections: a sender gone without a word releases its lane's threads
        # within keepalive_s + keepalive_timeout_s, not at the kernel's TCP timeout (hours).
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8 + max_lanes),
                                  options=[*OPTIONS, *server_keepalive(keepalive_s, keepalive_timeout_s)])
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Push": grpc.stream_unary_rpc_method_handler(self._push),
            "Lane": grpc.stream_stream_rpc_method_handler(self.lanes.serve)})
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_secure_port(f"{host}:{port}", server_credentials) if server_credentials \
            else self.server.add_insecure_port(f"{host}:{port}")
        self.address = f"grpc://{advertise_host or host}:{self.port}"
        self.server.start()

    def _push(self, request_iterator, context) -> bytes:
        """One transfer on a call of its own: the reply waits for the owner's ack."""
        done = threading.Event()
        replies: list[bytes] = []

        def reply(ack: bytes) -> None:
            replies.append(ack)
            done.set()

        self._receive(request_iterator, reply, lane=False)
        if not done.wait(self.ack_timeout_s):
            return ack_message("", False, "receiver did not process the transfer in time")
        return replies[0]

    def _receive(self, messages: Iterator[bytes], reply: Callable[[bytes], None], lane: bool = True) -> bool:
        """Read one transfer from `messages` and hand it to the owner, whose ack goes to `reply`
        (msgpack); a transfer refused before it reaches the owner is answered at once. On a
        `lane`, only the KV's own messages are read (its header says how many), and the result
        says whether all of them were: where a KV was left part-read, its lane cannot go on."""
        rid, one_message = "", False
        try:
            raw, tag, rest = parse_opening(next(messages))
            header = KVHeader.decode(raw)
            rid, more = header.request_id, messages_after_opening(header)
            one_message = not more
            if lane:
                messages = itertools.islice(messages, more)
            key = authorize(self.keys, header, raw, tag)  # before any frame byte is read
            # A larger KV's chunks are read ahead while each is checked and landed.
            more = messages if one_message else _read_ahead(messages)
            reader = _Reader(itertools.chain((rest,), more))
        except StopIteration:
            reply(ack_message(rid, False, f"{rid}: stream ended early (truncated)"))
            return False
        except (TransferError, ValueError) as e:
            reply(ack_message(rid, False, str(e)))
            return one_message
        frames: list[memoryview] = []
        error = ""
        try:
            if self.sink is not None:
                self.sink.open(header)
            for index, info in enumerate(header.frames):
                digest = _read_prefix(reader, header, index, key)
                buf = reader.read(info.nbytes)
                header.frames[index].checksum = digest  # the owner's checks read it there
                if self.sink is None:
                    verify_frame_size(header, index, buf.nbytes)
                    frames.append(buf)
                else:
                    verify_frame(header, index, buf)
                    self.sink.frame(header, index, buf)
            if not reader.at_end():
                raise TransferError(f"{rid}: more data than the header announces")
        except StopIteration:
            error = f"{rid}: stream ended early (truncated)"
        except (TransferError, ValueError) as e:
            error = str(e)
        if error and self.sink is None:
            reply(ack_message(rid, False, error))
            return one_message

        # Landed already (with a sink), or whole for the owner to check: the owner acks either way.
        def ack(ok: bool, err: str) -> None:
            reply(ack_message(rid, ok, err))

        self._queue.put(ReceivedKV(header, frames, ack, landed=self.sink is not None, error=error))
        return one_message or not error

    def poll(self, timeout_s: float = 0.0) -> list[ReceivedKV]:
        return drain(self._queue, timeout_s)

    def close(self) -> None:
        self.server.stop(grace=0)


def _read_prefix(reader: _Reader, header: KVHeader, index: int, key: bytes | None) -> int:
    """The digest of frame `index`, from the prefix before it, once its tag checks out (with a
    key) and it agrees with the header's digest (where the header has one)."""
    got, digest, tlen = FRAME_PREFIX.unpack(reader.read(FRAME_PREFIX.size))
    if got != index or tlen > MAX_TAG_BYTES:
        raise TransferError(f"{header.request_id}: frame {got} (tag of {tlen} bytes) where frame {index} was due")
    tag = bytes(reader.read(tlen))
    if key is not None and not hmac.compare_digest(frame_tag(key, header.transfer_id, index, digest), tag):
        raise TransferError(f"{header.request_id}: frame {index} is not signed with the reservation's key")
    if header.frames[index].checksum not in (0, digest):
        raise TransferError(f"{header.request_id}: frame {index}'s digest differs from the header's")
    return digest


_END = object()


def _read_ahead(messages: Iterator[bytes], depth: int = 2) -> Iterator[bytes]:
    """`messages`, read up to `depth` ahead on a thread of its own: grpcio asks the wire for the
    next message only when its iterator is called, so while the handler checked and landed a
    chunk, the sender stalled on flow control. Two receivers in one process, with and without,
    taking turns (bench/transfer.py's pairing), eight runs: 16 MiB 1.00-1.12x the throughput
    (median 1.07, none below 1); 256 MiB 0.95-1.02x (median 0.98: both cores are busy there
    already, and 1 MiB, where nothing differs, swung 0.93-1.09 in the same runs). The thread ends
    with the call: on its last message, its error, or once the reader is gone."""
    got: queue.SimpleQueue = queue.SimpleQueue()
    room = threading.Semaphore(depth)
    stop = threading.Event()

    def pump() -> None:
        try:
            while room.acquire() and not stop.is_set():
                got.put(next(messages))
        except StopIteration:
            got.put(_END)
        except Exception as e:  # the call broke or was cancelled: the reader raises it
            got.put(e)

    threading.Thread(target=pump, name="kv-grpc-read-ahead", daemon=True).start()
    try:
        while (message := got.get()) is not _END:
            if isinstance(message, Exception):
                raise message
            room.release()
            yield message
    finally:
        stop.set()
        room.release()  # a pump waiting for room wakes, sees stop and ends


class _Reader:
    """The call's bytes after the opening, read in order across its messages: a read within one
    message is a view of it (a frame of one chunk is not copied), one across messages a copy."""

    def __init__(self, messages: Iterator[bytes | memoryview]) -> None:
        self.messages = messages
        self.buf = memoryview(b"")

    def _fill(self) -> None:
        while not self.buf.nbytes:  # StopIteration: the call ended early
            self.buf = memoryview(next(self.messages)).cast("B")

    def read(self, n: int) -> memoryview:
        if n == 0:
            return memoryview(b"")
        self._fill()
        if self.buf.nbytes >= n:
            out, self.buf = self.buf[:n], self.buf[n:]
            return out
        out, filled = bytearray(n), 0
        while filled < n:
            self._fill()
            take = min(n - filled, self.buf.nbytes)
            out[filled:filled + take], self.buf = self.buf[:take], self.buf[take:]
            filled += take
        return memoryview(out)

    def at_end(self) -> bool:
        return not self.buf.nbytes and next(self.messages, None) is None
