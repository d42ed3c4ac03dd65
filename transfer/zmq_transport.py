"""ZeroMQ transport (the default): DEALER -> ROUTER, header frame + zero-copy data frames,
acknowledgement back on the same socket pair."""

from __future__ import annotations

import collections
import itertools
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import zmq

from transfer.base import KVReceiver, KVSender, KVSink, ReceivedKV, TransferHandle, TransferState
from transfer.wire import KVHeader, TransferError, checksum, verify_frame, verify_layout

DEFAULT_HWM = 1024  # messages queued per peer before senders block: bounds memory held by ZeroMQ
HEADER, FRAME = b"H", b"F"  # a transfer is one header message, then one message per frame


@dataclass(slots=True)
class _Incoming:
    ident: bytes
    header: KVHeader
    frames: list = field(default_factory=list)
    received: int = 0
    error: str = ""


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


class ZmqSender(KVSender):
    def __init__(self, hwm: int = DEFAULT_HWM, context: zmq.Context | None = None) -> None:
        self.ctx = context or zmq.Context()
        self._own_ctx = context is None
        self.hwm = hwm
        self.sockets: dict[str, zmq.Socket] = {}
        self.open: dict[str, TransferHandle] = {}  # transfer id -> handle
        self._ids = itertools.count()

    def _socket(self, dest: str) -> zmq.Socket:
        sock = self.sockets.get(dest)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.setsockopt(zmq.RCVHWM, self.hwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(dest if "://" in dest else f"tcp://{dest}")
            self.sockets[dest] = sock
        return sock

    def send(self, dest: str, header: KVHeader, frames: Sequence[memoryview], timeout_s: float) -> TransferHandle:
        handle = TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)
        header.transfer_id = f"{header.request_id}#{next(self._ids)}"
        handle.transfer_id = header.transfer_id
        sock = self._socket(dest)
        sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 1))
        tid = header.transfer_id.encode()
        try:
            sock.send_multipart([HEADER, header.encode()], copy=False)
            # One message per frame, each with its own checksum computed just before it goes out:
            # hashing frame i+1 overlaps ZeroMQ's I/O thread putting frame i on the wire.
            for i, frame in enumerate(frames):
                digest = header.frames[i].checksum or checksum(frame)
                header.frames[i].checksum = digest
                sock.send_multipart([FRAME, tid, struct.pack("<IQ", i, digest), frame], copy=False)
        except zmq.Again:
            handle.advance(TransferState.FAILED, f"send to {dest} timed out (peer not draining)")
            return handle
        except zmq.ZMQError as e:
            handle.advance(TransferState.FAILED, f"send to {dest} failed: {e}")
            return handle
        handle.advance(TransferState.SENT)
        self.open[header.transfer_id] = handle
        return handle

    def poll(self) -> None:
        for sock in self.sockets.values():
            while True:
                try:
                    raw = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    ack = msgpack.unpackb(raw)
                    handle = self.open.pop(ack["tid"], None)
                except Exception:
                    continue  # a garbled ack cannot be matched; the timeout will fail the transfer
                if handle is not None:
                    ok = bool(ack.get("ok"))
                    handle.advance(TransferState.DONE if ok else TransferState.FAILED, ack.get("err", ""))
        now = time.monotonic()
        for key, handle in list(self.open.items()):
            if handle.done:
                self.open.pop(key)
            elif now > handle.deadline:
                handle.advance(TransferState.FAILED, f"no acknowledgement from {handle.dest} before the timeout")
                self.open.pop(key)

    def abandon(self, handle: TransferHandle) -> None:
        super().abandon(handle)
        self.open.pop(handle.transfer_id, None)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
        if self._own_ctx:
            self.ctx.term()


class ZmqReceiver(KVReceiver):
    """Binds a ROUTER socket. Frames are checked as they arrive and, when a sink is set, handed
    to it at once; the completed transfer then comes out of `poll()`. Not thread-safe except
    `ack`, which may come from any thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 hwm: int = DEFAULT_HWM, sink: KVSink | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(tcp_address(host, port))
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self.address = tcp_address(advertise_host or host, port)
        self.sink = sink
        self._incoming: dict[bytes, _Incoming] = {}
        self._acks: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._lock = threading.RLock()
        self._owner: int | None = None  # the thread that polls (and so may use the socket)

    def _queue_ack(self, ident: bytes, tid: str, ok: bool, err: str) -> None:
        with self._lock:
            self._acks.append((ident, msgpack.packb({"tid": tid, "ok": ok, "err": err})))
        if threading.get_ident() == self._owner:
            self._flush_acks()  # on the socket's own thread: no need to wait for the next poll

    def _flush_acks(self) -> None:
        with self._lock:
            while self._acks:
                ident, msg = self._acks.popleft()
                try:
                    self.sock.send_multipart([ident, msg], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the peer is gone; its own timeout reports the failure

    def poll(self, timeout_s: float = 0.0) -> list[ReceivedKV]:
        self._owner = threading.get_ident()
        self._flush_acks()
        out: list[ReceivedKV] = []
        if not self.sock.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            done = self._on_message(parts)
            if done is not None:
                out.append(done)
        self._flush_acks()
        return out

    def _on_message(self, parts) -> ReceivedKV | None:
        ident = parts[0].bytes
        kind = parts[1].bytes if len(parts) > 1 else b""
        if kind == HEADER and len(parts) == 3:
            try:
                header = KVHeader.decode(parts[2].buffer)
                verify_layout(header)
            except TransferError as e:
                self._queue_ack(ident, "", False, str(e))
                return None
            inc = _Incoming(ident, header)
            self._incoming[header.transfer_id.encode()] = inc
            if self.sink is not None:
                try:
                    self.sink.open(header)
                except TransferError as e:
                    inc.error = str(e)
            return self._finish_if_complete(header.transfer_id.encode(), inc)
        if kind == FRAME and len(parts) == 5:
            tid = parts[2].bytes
            inc = self._incoming.get(tid)
            if inc is None:
                return None  # a transfer already refused or finished: drop its stragglers
            inc.received += 1
            if not inc.error:
                index, digest = struct.unpack("<IQ", parts[3].bytes)
                buf = parts[4].buffer
                try:
                    verify_frame(inc.header, index, buf, digest)
                    inc.header.frames[index].checksum = digest
                    if self.sink is not None:
                        self.sink.frame(inc.header, index, buf)
                    else:
                        inc.frames.append((index, buf))
                except TransferError as e:
                    inc.error = str(e)
            return self._finish_if_complete(tid, inc)
        self._queue_ack(ident, "", False, "malformed transfer message")
        return None

    def _finish_if_complete(self, tid: bytes, inc: _Incoming) -> ReceivedKV | None:
        if inc.received < len(inc.header.frames):
            return None
        del self._incoming[tid]
        frames = [buf for _, buf in sorted(inc.frames, key=lambda x: x[0])]
        t = tid.decode()
        rx = ReceivedKV(inc.header, frames, lambda ok, err, i=inc.ident: self._queue_ack(i, t, ok, err),
                        landed=self.sink is not None, error=inc.error)
        return rx

    def close(self) -> None:
        self._flush_acks()
        self.sock.close(linger=0)
        self.ctx.term()
