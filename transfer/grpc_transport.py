"""gRPC transport for deployments that open only gRPC ports.

A call per transfer on a generic method, or a message on a lane (below); messages are raw bytes
(no protobuf around bulk data). The first holds the lengths of the msgpack header and of its tag
under the reservation's transfer key, then both, then, when the KV fits one chunk, all its
frames; otherwise chunks of the frames follow. The reply is the msgpack acknowledgement. Under
mtls the call runs over TLS with the cluster's certificates (passed in as plain grpc credentials).

Each frame comes after its index, xxh3 digest and tag (wire.frame_tag), hashed as it is cut into
chunks, as on ZeroMQ. With every digest in the header instead, the sender hashed the whole KV
before its first byte left (256 MiB: ~9 ms here). The header's tag is checked before any frame is
read, and a frame's before its bytes are.

A KV of one chunk is one message each way: against three (header, tag, chunk), a 1 MiB transfer
took 7-12% less time (paired, one process pair). Between a sender and a receiver a KV goes on a
lane (transfer/grpc_lane.py), one bidirectional call kept open, which saves each KV the cost of a
call of its own; until the lane is open, or while it carries a larger KV, a transfer is one
client-streaming call. bench/transfer.py, 1 MiB, against a raw client stream of the same bytes
sent beside it: 0.89-1.04 (thirteen runs, security off and token) where a call per KV read
0.63-0.81. Larger KV, the same KV on the lane or on a call of its own, in turns in one
process: the lane took 0.94x the time at 8 MiB and 0.97-1.00x at 16 MiB, and was slower beyond
(grpc_lane.LANE_MAX_BYTES).

Tried before lanes: a blocking unary call per one-chunk KV, on a pool of the sender's threads
(as `.future()` from the sender thread it took 1.4-1.55x as long), was 1.21-1.31x the stream's
throughput; larger KV sent as blocking streams gained nothing measurable."""

from __future__ import annotations

import hmac
import itertools
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import grpc
import msgpack

from transfer.base import KVReceiver, KVSender, KVSink, ReceivedKV, TransferHandle, TransferState, drain
from transfer.grpc_lane import (
    LANE_IDLE_S,
    LANE_MAX_BYTES,
    LANE_RETRY_S,
    MAX_LANES,
    LaneServer,
    SenderLane,
    ack_message,
)
from transfer.wire import (
    KeyLookup,
    KVHeader,
    TransferError,
    authorize,
    checksum,
    frame_tag,
    header_tag,
    verify_frame,
    verify_frame_size,
)

# The service's name carries the wire's generation: a sender and a receiver of different ones
# (a cluster half upgraded) meet UNIMPLEMENTED, not frames they misread. 2: per-frame digests;
# 3: lanes for one-chunk KV (the unary PushOne gone); 4: KV of any size on a lane.
SERVICE = "pdserve.kv4.KVTransfer"
METHOD = f"/{SERVICE}/Push"  # client-streaming: one KV (of any size)
METHOD_LANE = f"/{SERVICE}/Lane"  # bidirectional: many KV, one after another (grpc_lane)
CHUNK = 4 << 20
_OPTIONS = [("grpc.max_receive_message_length", 2 * CHUNK), ("grpc.max_send_message_length", 2 * CHUNK)]
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 60.0, 20.0  # the receiver pings a connection silent this long
_OPENING = struct.Struct("<II")  # the first message's header and tag lengths
_FRAME = struct.Struct("<IQB")  # before each frame: its index, xxh3 digest and tag length
MAX_TAG_BYTES = 64
MAX_HEADER_BYTES = 1 << 20  # a longer header is refused before it is decoded


def _server_keepalive(every_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """A ping after `every_s` without traffic on a connection with a call open, and the connection
    closed when `timeout_s` passes unanswered. grpcio (1.85) times the ping by
    `grpc.http2.ping_timeout_ms`, whose default is a minute, and not by `keepalive_timeout_ms`
    (grpc/grpc#39239): with only the latter set, a frozen sender held its lane 61 s past a 1 s
    ping. Both are set, for versions that honour either."""
    every, timeout = round(every_s * 1000), round(timeout_s * 1000)
    return [("grpc.keepalive_time_ms", every), ("grpc.keepalive_timeout_ms", timeout),
            ("grpc.http2.ping_timeout_ms", timeout)]


def _chunks(header: KVHeader, frames: Sequence[memoryview], key: bytes | None) -> Iterator[bytes]:
    """The call's messages: the opening (lengths, header, tag, and all frames when they fit one
    chunk), then the frames in chunks of at most CHUNK bytes, each within one frame, a frame's
    first chunk led by its prefix (_prefix). Every byte is copied once, as gRPC takes only bytes.
    A larger KV's header goes ahead alone, so that the receiver checks it while the first chunk
    is on the wire; each frame is hashed only when its turn comes (on grpcio's thread that
    drains this generator), so hashing overlaps the wire."""
    raw = header.encode()
    tag = header_tag(key, raw)
    views = [memoryview(f).cast("B") for f in frames]
    opening = [_OPENING.pack(len(raw), len(tag)), raw, tag]
    if not _messages_after_opening(header):  # the receiver counts the messages by the same rule
        for i, mv in enumerate(views):
            opening += [_prefix(header, i, mv, key), mv]
        yield b"".join(opening)
        return
    yield b"".join(opening)
    for i, mv in enumerate(views):
        yield b"".join((_prefix(header, i, mv, key), mv[:CHUNK]))
        for j in range(CHUNK, mv.nbytes, CHUNK):
            yield bytes(mv[j:j + CHUNK])


def _prefix(header: KVHeader, index: int, frame: memoryview, key: bytes | None) -> bytes:
    """A frame's index, digest (the header's when it has one) and tag."""
    digest = header.frames[index].checksum or checksum(frame)
    tag = frame_tag(key, header.transfer_id, index, digest)
    return _FRAME.pack(index, digest, len(tag)) + tag


def _opening(first: bytes) -> tuple[bytes, bytes, memoryview]:
    """The first message's header, tag and the frame bytes after them."""
    if len(first) < _OPENING.size:
        raise TransferError("transfer opening shorter than its length prefix")
    hlen, tlen = _OPENING.unpack_from(first)
    end = _OPENING.size + hlen + tlen
    if hlen > MAX_HEADER_BYTES or end > len(first):
        raise TransferError(f"transfer opening announces a {hlen}-byte header and a {tlen}-byte tag in "
                            f"{len(first)} bytes")
    view = memoryview(first)
    return bytes(view[_OPENING.size:_OPENING.size + hlen]), bytes(view[_OPENING.size + hlen:end]), view[end:]


def _messages_after_opening(header: KVHeader) -> int:
    """How many messages follow a KV's opening (_chunks): none when it fits one chunk, else each
    frame's bytes in chunks of CHUNK (at least one message a frame, for its prefix)."""
    if header.total_bytes <= CHUNK:
        return 0
    return sum(max(1, -(-f.nbytes // CHUNK)) for f in header.frames)


class GrpcSender(KVSender):
    def __init__(self, channel_credentials: grpc.ChannelCredentials | None = None,
                 channel_options: list | None = None, lane_idle_s: float = LANE_IDLE_S,
                 lane_max_bytes: int = LANE_MAX_BYTES) -> None:
        super().__init__()
        self.lane_idle_s, self.lane_max_bytes = lane_idle_s, lane_max_bytes
        self.channels: dict[str, grpc.Channel] = {}
        self.lanes: dict[str, SenderLane] = {}
        self._no_lane_until: dict[str, float] = {}  # dest -> when to try a lane again
        self.open: list[tuple[TransferHandle, grpc.Future | futures.Future]] = []
        self.credentials, self.options = channel_credentials, [*_OPTIONS, *(channel_options or [])]
        self._ids = itertools.count()

    def _channel(self, dest: str) -> grpc.Channel:
        if dest not in self.channels:
            self.channels[dest] = grpc.secure_channel(dest, self.credentials, options=self.options) \
                if self.credentials else grpc.insecure_channel(dest, options=self.options)
        return self.channels[dest]

    def _lane(self, dest: str) -> SenderLane | None:
        """The lane to `dest`, opening one when there is none (it is not open yet then)."""
        lane = self.lanes.get(dest)
        if lane is not None and lane.dead:
            del self.lanes[dest]
            if not lane.ready:  # refused, or the receiver unreachable: calls per KV for a while
                self._no_lane_until[dest] = time.monotonic() + LANE_RETRY_S
            lane = None
        if lane is None and time.monotonic() >= self._no_lane_until.get(dest, 0.0):
            lane = self.lanes[dest] = SenderLane(self._channel(dest).stream_stream(METHOD_LANE), dest)
        return lane

    def send(self, dest: str, header: KVHeader, frames: Sequence[memoryview], timeout_s: float,
             key: bytes | None = None, peer_key: str = "") -> TransferHandle:
        handle = TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)
        # Frame tags name the transfer: a frame of one part of a KV cannot pass for another's.
        header.transfer_id = handle.transfer_id = f"{header.request_id}#{next(self._ids)}"
        dest = dest.removeprefix("grpc://")
        messages, bulk = _chunks(header, frames, key), _messages_after_opening(header) > 0
        if not bulk:  # made now: a lane may send it later, its frames freed by then
            messages = iter((next(messages),))
        # Opened whatever the KV's size: an open lane also keeps the channel's polling thread,
        # which grpcio otherwise starts again for each call on an idle channel.
        lane = self._lane(dest)
        fut = None
        if lane is not None and header.total_bytes <= self.lane_max_bytes:
            fut = lane.send(messages, bulk=bulk)
        if fut is None:  # no lane open, it is busy with a bulk KV, or the KV is larger than it takes
            fut = self._channel(dest).stream_unary(METHOD).future(messages, timeout=timeout_s)
        fut.add_done_callback(lambda _: self.wake())  # the reply (or error) ends a sender thread's wait
        handle.advance(TransferState.SENT)
        self.open.append((handle, fut))
        return handle

    def poll(self) -> None:
        still = []
        for handle, fut in self.open:
            if handle.done and not fut.done():  # failed meanwhile (its deadline): stop waiting
                self._drop(fut)
                continue
            if not fut.done():
                still.append((handle, fut))
                continue
            try:
                reply = fut.result()
            except grpc.RpcError as e:
                handle.advance(TransferState.FAILED, f"gRPC transfer to {handle.dest}: {e.code().name} {e.details()}")
                continue
            except Exception as e:  # the lane it went on closed or broke
                handle.advance(TransferState.FAILED, f"gRPC transfer to {handle.dest}: {e}")
                continue
            try:
                ack = msgpack.unpackb(reply)
                ok = bool(ack.get("ok"))
                handle.advance(TransferState.DONE if ok else TransferState.FAILED, ack.get("err", ""))
            except Exception as e:
                handle.advance(TransferState.FAILED, f"bad acknowledgement from {handle.dest}: {e}")
        self.open = still
        for dest, lane in list(self.lanes.items()):
            if lane.ready and lane.idle(self.lane_idle_s):
                lane.close()
                del self.lanes[dest]

    @property
    def num_sockets(self) -> int:
        """Lanes open to receivers: the long-lived connections of this sender, as ZeroMQ's
        peer sockets are (the workers' `peer_sockets` gauge); idle ones close."""
        return sum(not lane.dead for lane in self.lanes.values())

    def abandon(self, handle: TransferHandle) -> None:
        """A stream is cancelled; a KV on a lane has left already, and the receiver refuses it
        once its reservation has gone."""
        super().abandon(handle)
        for h, fut in self.open:
            if h is handle:
                self._drop(fut)
        self.open = [(h, f) for h, f in self.open if h is not handle]

    def _drop(self, fut: grpc.Future | futures.Future) -> None:
        """Stop waiting for a transfer's reply: a stream is cancelled; a lane forgets the KV's
        sequence number (its late ack is ignored, and the lane can go idle)."""
        fut.cancel()
        for lane in self.lanes.values():
            lane.forget(fut)

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
        for ch in self.channels.values():
            ch.close()  # cancels every call on it
        self.channels.clear()


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
                                  options=[*_OPTIONS, *_server_keepalive(keepalive_s, keepalive_timeout_s)])
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
            raw, tag, rest = _opening(next(messages))
            header = KVHeader.decode(raw)
            rid, more = header.request_id, _messages_after_opening(header)
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
    got, digest, tlen = _FRAME.unpack(reader.read(_FRAME.size))
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
