"""gRPC transport for deployments that open only gRPC ports.

One call per transfer on a generic method; messages are raw bytes (no protobuf around bulk data).
The first holds the lengths of the msgpack header and of its tag under the reservation's transfer
key, then both, then, when the KV fits one chunk, all its frames; otherwise chunks of the frames
follow. The reply is the msgpack acknowledgement. Under mtls the call runs over TLS with the
cluster's certificates (passed in as plain grpc credentials).

Each frame comes after its index, xxh3 digest and tag (wire.frame_tag), hashed as it is cut into
chunks, as on ZeroMQ. With every digest in the header instead, the sender hashed the whole KV
before its first byte left (256 MiB: ~9 ms here). The header's tag is checked before any frame is
read, and a frame's before its bytes are.

A KV of one chunk is one message each way: against three (header, tag, chunk), a 1 MiB transfer
took 7-12% less time (paired, one process pair). That message goes as a unary call (PushOne),
made blocking on a small pool of the sender's threads. A client-streaming call starts a thread per
call to drain its request iterator, and a non-blocking call (`.future()`) hands its completion to
the channel's polling thread; a blocking unary call has neither. 1 MiB through the real receiver,
two processes, 95 pairs each time: 0.80 and 0.84x the time of the stream (faster in 86 and 82 of
95); in bench/transfer.py's setting (both signed, one receiver, in turns), 1.21 and 1.31x the
stream's throughput. The same unary call made with `.future()` from the sender thread took
1.4-1.55x the stream's time; larger KV sent as blocking streams on the pool instead of
`.future()` gained nothing measurable (16 MiB 0.99/1.02, 256 MiB 1.03/0.98). With every pool
thread busy (a slow peer holds one until its deadline), a transfer goes as a stream: nobody waits
for a thread."""

from __future__ import annotations

import hmac
import itertools
import queue
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import msgpack

from transfer.base import KVReceiver, KVSender, KVSink, ReceivedKV, TransferHandle, TransferState, drain
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
# (a cluster half upgraded) meet UNIMPLEMENTED, not frames they misread. 2: per-frame digests.
SERVICE = "pdserve.kv2.KVTransfer"
METHOD = f"/{SERVICE}/Push"  # client-streaming: a KV of more than one chunk
METHOD_ONE = f"/{SERVICE}/PushOne"  # unary: a KV of one chunk, in the opening message
CHUNK = 4 << 20
_OPTIONS = [("grpc.max_receive_message_length", 2 * CHUNK), ("grpc.max_send_message_length", 2 * CHUNK)]
_OPENING = struct.Struct("<II")  # the first message's header and tag lengths
_FRAME = struct.Struct("<IQB")  # before each frame: its index, xxh3 digest and tag length
MAX_TAG_BYTES = 64
MAX_HEADER_BYTES = 1 << 20  # a longer header is refused before it is decoded
CALL_THREADS = 4  # one-chunk transfers on blocking unary calls at once; more go as streams


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
    if header.total_bytes <= CHUNK:
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


class GrpcSender(KVSender):
    def __init__(self, channel_credentials: grpc.ChannelCredentials | None = None,
                 channel_options: list | None = None) -> None:
        super().__init__()
        self.channels: dict[str, grpc.Channel] = {}
        self.open: list[tuple[TransferHandle, grpc.Future | futures.Future]] = []
        self.credentials, self.options = channel_credentials, [*_OPTIONS, *(channel_options or [])]
        # Created by the sender thread on first use, so its threads inherit that thread's priority.
        self._pool: futures.ThreadPoolExecutor | None = None
        self._calls: list[futures.Future] = []  # the pool's calls (sender thread only)
        self._ids = itertools.count()

    def _call(self, dest: str, unary: bool = False):
        dest = dest.removeprefix("grpc://")
        if dest not in self.channels:
            self.channels[dest] = grpc.secure_channel(dest, self.credentials, options=self.options) \
                if self.credentials else grpc.insecure_channel(dest, options=self.options)
        channel = self.channels[dest]
        return channel.unary_unary(METHOD_ONE) if unary else channel.stream_unary(METHOD)

    def send(self, dest: str, header: KVHeader, frames: Sequence[memoryview], timeout_s: float,
             key: bytes | None = None, peer_key: str = "") -> TransferHandle:
        handle = TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)
        # Frame tags name the transfer: a frame of one part of a KV cannot pass for another's.
        header.transfer_id = handle.transfer_id = f"{header.request_id}#{next(self._ids)}"
        messages = _chunks(header, frames, key)
        self._calls = [f for f in self._calls if not f.done()]
        if header.total_bytes <= CHUNK and len(self._calls) < CALL_THREADS:
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="kv-grpc-call")
            fut = self._pool.submit(self._call(dest, unary=True), next(messages), timeout=timeout_s)
            self._calls.append(fut)
        else:
            fut = self._call(dest).future(messages, timeout=timeout_s)
        fut.add_done_callback(lambda _: self.wake())  # the reply (or error) ends a sender thread's wait
        handle.advance(TransferState.SENT)
        self.open.append((handle, fut))
        return handle

    def poll(self) -> None:
        still = []
        for handle, fut in self.open:
            if not fut.done():
                still.append((handle, fut))
                continue
            try:
                ack = msgpack.unpackb(fut.result())
                ok = bool(ack.get("ok"))
                handle.advance(TransferState.DONE if ok else TransferState.FAILED, ack.get("err", ""))
            except grpc.RpcError as e:
                handle.advance(TransferState.FAILED, f"gRPC transfer to {handle.dest}: {e.code().name} {e.details()}")
            except Exception as e:
                handle.advance(TransferState.FAILED, f"bad acknowledgement from {handle.dest}: {e}")
        self.open = still

    def abandon(self, handle: TransferHandle) -> None:
        """A stream is cancelled; a blocking unary call cannot be, and ends on its reply or at its
        deadline (the receiver refuses a KV whose reservation has gone)."""
        super().abandon(handle)
        for h, fut in self.open:
            if h is handle:
                fut.cancel()
        self.open = [(h, f) for h, f in self.open if h is not handle]

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()  # cancels every call on it, the pool's blocking ones included
        self.channels.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class GrpcReceiver(KVReceiver):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 ack_timeout_s: float = 60.0, keys: KeyLookup | None = None,
                 server_credentials: grpc.ServerCredentials | None = None, sink: KVSink | None = None) -> None:
        """With a `sink`, each frame is checked and handed over as it arrives, from the chunk
        gRPC already holds (no reassembly copy when a frame fits one chunk)."""
        self._queue: queue.Queue[ReceivedKV] = queue.Queue()
        self.keys, self.sink = keys, sink
        self.ack_timeout_s = ack_timeout_s
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_OPTIONS)
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Push": grpc.stream_unary_rpc_method_handler(self._push),
            "PushOne": grpc.unary_unary_rpc_method_handler(lambda msg, context: self._push(iter((msg,)), context))})
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_secure_port(f"{host}:{port}", server_credentials) if server_credentials \
            else self.server.add_insecure_port(f"{host}:{port}")
        self.address = f"grpc://{advertise_host or host}:{self.port}"
        self.server.start()

    def _push(self, request_iterator, context) -> bytes:
        rid = ""
        try:
            raw, tag, rest = _opening(next(request_iterator))
            header = KVHeader.decode(raw)
            rid = header.request_id
            key = authorize(self.keys, header, raw, tag)  # before any frame byte is read
            reader = _Reader(itertools.chain((rest,), request_iterator))
        except StopIteration:
            return msgpack.packb({"rid": rid, "ok": False, "err": f"{rid}: stream ended early (truncated)"})
        except (TransferError, ValueError) as e:
            return msgpack.packb({"rid": rid, "ok": False, "err": str(e)})
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
            return msgpack.packb({"rid": rid, "ok": False, "err": error})
        done = threading.Event()
        result: dict = {}

        def ack(ok: bool, err: str) -> None:
            result.update(ok=ok, err=err)
            done.set()

        # Landed already (with a sink), or whole for the owner to check: the owner acks either way.
        self._queue.put(ReceivedKV(header, frames, ack, landed=self.sink is not None, error=error))
        if not done.wait(self.ack_timeout_s):
            return msgpack.packb({"rid": rid, "ok": False, "err": "receiver did not process the transfer in time"})
        return msgpack.packb({"rid": rid, **result})

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
