"""The ZeroMQ transport's receiving end: a ROUTER socket that checks each message's tag before it
may touch anything, checks and lands frames as they arrive, and acknowledges each transfer (the
message format: transfer/zmq_transport.py)."""

from __future__ import annotations

import collections
import hmac
import threading
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from transfer.base import KVReceiver, KVSink, ReceivedKV
from transfer.shared_memory import RegionMaps, offer_key
from transfer.wire import (
    KeyLookup,
    KVHeader,
    TransferError,
    authorize,
    frame_tag,
    verify_frame,
    verify_frame_size,
    verify_layout,
)
from transfer.zmq_transport import DEFAULT_HWM, FRAME, HEADER, INDEX, tcp_address

PARTIAL_TIMEOUT_S = 30.0  # a receiver drops a transfer whose frames stop coming for this long
MAX_PARTIAL = 256  # transfers a receiver holds open at once ...
MAX_PARTIAL_BYTES = 4 << 30  # ... announcing at most this many bytes together
MAX_MESSAGE_BYTES = (16 << 20) + (1 << 20)  # one frame (transfer.max_frame_bytes) and its envelope
MAX_PER_PEER = 64  # transfers one connected sender may hold open at a receiver


@dataclass(slots=True)
class _Incoming:
    ident: bytes
    header: KVHeader
    deadline: float
    key: bytes | None = None
    frames: list = field(default_factory=list)
    received: int = 0
    error: str = ""
    mapped: bool | None = None  # the sender's offered memory: mapped here (None: none offered)


class ZmqReceiver(KVReceiver):
    """Binds a ROUTER socket. Frames are checked as they arrive and, when a sink is set, handed
    to it at once; the completed transfer then comes out of `poll()`. Not thread-safe except
    `ack`, which may come from any thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 hwm: int = DEFAULT_HWM, sink: KVSink | None = None, partial_timeout_s: float = PARTIAL_TIMEOUT_S,
                 max_partial: int = MAX_PARTIAL, max_partial_bytes: int = MAX_PARTIAL_BYTES,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, keys: KeyLookup | None = None, curve: bool = False,
                 max_per_peer: int = MAX_PER_PEER, shared_memory: bool = True) -> None:
        """`keys`: the transfer key of a header's reservation (TransferError: no such reservation);
        without it nothing is checked (unit tests, the security-off benchmark). `shared_memory`:
        map what a sender on this host offers, and take its frames by reference."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.keys, self.max_per_peer = keys, max_per_peer
        self.public_key = ""
        if curve:
            public, secret = zmq.curve_keypair()
            self.sock.curve_server = True
            self.sock.curve_secretkey = secret
            self.public_key = public.decode()
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ drops a peer that sends a bigger message before any of it is buffered here.
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if port:
            self.sock.bind(tcp_address(host, port))
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self.address = tcp_address(advertise_host or host, port)
        self.sink = sink
        self.regions = RegionMaps(shared_memory)
        self._incoming: dict[bytes, _Incoming] = {}
        self.partial_timeout_s, self.max_partial, self.max_partial_bytes = \
            partial_timeout_s, max_partial, max_partial_bytes
        self._acks: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._lock = threading.RLock()
        self._owner: int | None = None  # the thread that polls (and so may use the socket)

    def _queue_ack(self, ident: bytes, tid: str, ok: bool, err: str, mapped: bool | None = None) -> None:
        ack = {"tid": tid, "ok": ok, "err": err, **({"shm": mapped} if mapped is not None else {})}
        with self._lock:
            self._acks.append((ident, msgpack.packb(ack)))
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
            self._expire()  # an idle receiver still lets go of transfers whose frames stopped
            self._flush_acks()
            return out
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            done = self._on_message(parts)
            if done is not None:
                out.append(done)
        self._expire()
        self._flush_acks()
        return out

    @property
    def num_partial(self) -> int:
        """Transfers whose header arrived and whose frames have not all come yet."""
        return len(self._incoming)

    def _expire(self) -> None:
        now = time.monotonic()
        for tid, inc in list(self._incoming.items()):
            if now > inc.deadline:
                del self._incoming[tid]
                self._queue_ack(inc.ident, tid.decode(), False, f"frames stopped coming for "
                                f"{self.partial_timeout_s:.0f}s ({inc.received}/{len(inc.header.frames)} arrived)")
        if self.regions.num_mapped:
            self.regions.expire({offer_key(i.header.shared["offer"]) for i in self._incoming.values()
                                 if i.header.shared.get("offer")})

    def _room_for(self, ident: bytes, header: KVHeader) -> str:
        """Why a new transfer cannot be taken now ("" when it can)."""
        if len(self._incoming) >= self.max_partial:
            return f"receiver busy: {len(self._incoming)} transfers already open"
        mine = sum(1 for i in self._incoming.values() if i.ident == ident)
        if mine >= self.max_per_peer:
            return f"receiver busy: this sender already has {mine} transfers open (limit {self.max_per_peer})"
        held = sum(i.header.total_bytes for i in self._incoming.values())
        if held + header.total_bytes > self.max_partial_bytes:
            return f"receiver busy: {held} bytes of open transfers, limit {self.max_partial_bytes}"
        return ""

    def _on_message(self, parts) -> ReceivedKV | None:
        ident = parts[0].bytes
        kind = parts[1].bytes if len(parts) > 1 else b""
        if kind == HEADER and len(parts) in (4, 7):
            try:
                header = KVHeader.decode(parts[2].buffer)
            except TransferError as e:
                self._queue_ack(ident, "", False, str(e))
                return None
            try:
                key = authorize(self.keys, header, parts[2].buffer, parts[3].bytes)
                verify_layout(header)
            except TransferError as e:
                self._queue_ack(ident, header.transfer_id, False, str(e))
                return None
            tid = header.transfer_id.encode()
            busy = self._room_for(ident, header) or ("transfer id already open" if tid in self._incoming else "")
            if busy:
                self._queue_ack(ident, header.transfer_id, False, busy)
                return None
            inc = _Incoming(ident, header, time.monotonic() + self.partial_timeout_s, key)
            self._incoming[tid] = inc
            if header.shared.get("offer"):
                inc.mapped = self.regions.map(header.shared["offer"])
                if header.shared.get("refs") and not inc.mapped:
                    inc.error = "KV sent by reference into memory this receiver cannot map"
            if self.sink is not None:
                try:
                    self.sink.open(header)
                except TransferError as e:
                    inc.error = str(e)
            if len(parts) == 7:  # the first frame rode along
                return self._on_frame(ident, tid, parts[4:])
            return self._finish_if_complete(tid, inc)
        if kind == FRAME and len(parts) == 6:
            return self._on_frame(ident, parts[2].bytes, parts[3:])
        self._queue_ack(ident, "", False, "malformed transfer message")
        return None

    def _on_frame(self, ident: bytes, tid: bytes, parts) -> ReceivedKV | None:
        """One frame's (index and xxh3, tag, bytes)."""
        inc = self._incoming.get(tid)
        if inc is None or inc.ident != ident:
            return None  # a transfer already refused or finished (or someone else's): drop it
        if len(parts[0].bytes) != INDEX.size:
            self._queue_ack(ident, tid.decode(errors="replace"), False, "malformed transfer message")
            return None
        index, digest = INDEX.unpack(parts[0].bytes)
        if inc.key is not None and not hmac.compare_digest(
                frame_tag(inc.key, inc.header.transfer_id, index, digest), parts[1].bytes):
            return None  # not from the key holder: it may not count against, or fail, the transfer
        inc.received += 1
        inc.deadline = time.monotonic() + self.partial_timeout_s  # still coming: keep it open
        if not inc.error:
            buf = parts[2].buffer
            try:
                if inc.header.shared.get("refs"):
                    self._by_reference(inc, index, digest, buf)
                else:
                    verify_frame(inc.header, index, buf, digest)
                    if self.sink is not None:
                        self.sink.frame(inc.header, index, buf)
                    else:
                        inc.frames.append((index, buf))
                inc.header.frames[index].checksum = digest
            except TransferError as e:
                inc.error = str(e)
        return self._finish_if_complete(tid, inc)

    def _by_reference(self, inc: _Incoming, index: int, digest: int, ref: memoryview) -> None:
        """A frame in the sender's memory, landed from there and then checked. The checksum reads
        the bytes after the copy: bytes the sender changed before or during it (blocks it reused
        after a cancel) fail it, and a failed transfer's blocks are never committed (the engine
        caches imported blocks only when the whole import commits). Hashing first and copying
        after would land whatever changed in between unchecked."""
        src = self.regions.frame(inc.header.shared["offer"], ref)
        if self.sink is None:  # kept past this call: a copy of its own, checked
            own = bytes(src)
            verify_frame(inc.header, index, own, digest)
            inc.frames.append((index, own))
            return
        verify_frame_size(inc.header, index, src.nbytes)
        self.sink.frame(inc.header, index, src)
        verify_frame(inc.header, index, src, digest)

    def _finish_if_complete(self, tid: bytes, inc: _Incoming) -> ReceivedKV | None:
        if inc.received < len(inc.header.frames):
            return None
        del self._incoming[tid]
        frames = [buf for _, buf in sorted(inc.frames, key=lambda x: x[0])]
        t = tid.decode()
        return ReceivedKV(inc.header, frames,
                          lambda ok, err, i=inc.ident, m=inc.mapped: self._queue_ack(i, t, ok, err, m),
                          landed=self.sink is not None, error=inc.error)

    def close(self) -> None:
        self._flush_acks()
        self.sock.close(linger=0)
        self.ctx.term()
        self.regions.close()
