"""ZeroMQ transport (the default): DEALER -> ROUTER, header frame + zero-copy data frames,
acknowledgement back on the same socket pair.

Messages: [H, header, tag] opens a transfer; [F, transfer id, (index, xxh3), tag, bytes] carries
one frame. The sender puts the first frame's three parts in the header's message, [H, header,
tag, (index, xxh3), tag, bytes]: a transfer of one frame (a short prompt's KV) is then one
message each way, where a message more cost ~0.15 ms of wake-ups on both ends of a 1 ms transfer.
With a key lookup the receiver checks each tag (wire.header_tag / frame_tag) before
the message may touch anything, so KV that is not signed with its reservation's one-time key is
refused without landing, and cannot fail the reservation either. Opt-in CURVE encrypts the
connection (the receiver's public key travels with the worker's registration).

On one host, frames inside memory the sender shares (`share`: the prefill worker's KV pool) go
as references into it once the receiver has said it can map that memory: see
transfer/shared_memory.py. The messages, checks and acknowledgements are the same."""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from transfer.base import KVReceiver, KVSender, KVSink, ReceivedKV, TransferHandle, TransferState
from transfer.shared_memory import RegionMaps, SharedRegion, cut_frames, offer_key
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
    verify_layout,
)

DEFAULT_HWM = 1024  # messages queued per peer before senders block: bounds memory held by ZeroMQ
IDLE_SOCKET_S = 60.0  # a sender closes its socket to a peer unused this long (or whose transfer failed)
PARTIAL_TIMEOUT_S = 30.0  # a receiver drops a transfer whose frames stop coming for this long
MAX_PARTIAL = 256  # transfers a receiver holds open at once ...
MAX_PARTIAL_BYTES = 4 << 30  # ... announcing at most this many bytes together
MAX_MESSAGE_BYTES = (16 << 20) + (1 << 20)  # one frame (transfer.max_frame_bytes) and its envelope
MAX_PER_PEER = 64  # transfers one connected sender may hold open at a receiver
HEADER, FRAME = b"H", b"F"  # a transfer is one header message, then one message per frame
_INDEX = struct.Struct("<IQ")  # a frame's index and xxh3 digest
log = logging.getLogger(__name__)


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


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


class ZmqSender(KVSender):
    def __init__(self, hwm: int = DEFAULT_HWM, context: zmq.Context | None = None, curve: bool = False) -> None:
        super().__init__()
        self.ctx = context or zmq.Context()
        # CURVE: this sender's own keypair (the receiver accepts any client: the transfer key, not
        # the connection, says who may write a reservation).
        self.curve = zmq.curve_keypair() if curve else None
        self._own_ctx = context is None
        self.hwm = hwm
        self.sockets: dict[str, zmq.Socket] = {}
        self.monitors: dict[str, zmq.Socket] = {}  # connection events per peer: a vanished peer's socket closes
        self.last_used: dict[str, float] = {}
        self.open: dict[str, TransferHandle] = {}  # transfer id -> handle
        self._ids = itertools.count()
        # wake() writes a byte here; wait() polls it beside the peer sockets.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller: zmq.Poller | None = None  # over the peer sockets and the wake pipe; rebuilt when they change
        self.region: SharedRegion | None = None  # memory offered to same-host receivers (share)
        self.peer_maps: dict[str, bool] = {}  # per destination: whether it maps the region (from its acks)
        self.bytes_by_reference = 0  # frames' bytes that went as references, not over the socket
        self.num_shared_peers = 0  # receivers that map the region (kept for readers on other threads)

    def share(self, fd: int, memory: memoryview) -> bool:
        self.region = SharedRegion.of(fd, memory)
        return self.region is not None

    def _references(self, dest: str, header: KVHeader, frames: Sequence[memoryview],
                    ) -> tuple[list[bytes] | None, Sequence[memoryview]]:
        """The frames as references (cut to pieces of at most PIECE_BYTES) when the receiver maps
        the region and all lie in it; the offer rides in the header until the receiver has said whether it
        can map it."""
        if self.region is None or self.peer_maps.get(dest) is False:
            return None, frames
        use = bool(frames) and bool(self.peer_maps.get(dest)) and all(self.region.ref(f) for f in frames)
        header.shared = {"offer": self.region.offer, "refs": use}
        if not use:
            return None, frames
        frames = cut_frames(header, list(frames))
        return [self.region.ref(f) for f in frames], frames

    def _socket(self, dest: str, peer_key: str = "") -> zmq.Socket:
        self.last_used[dest] = time.monotonic()
        sock = self.sockets.get(dest)
        if sock is None:
            if self.curve is not None and not peer_key:
                raise zmq.ZMQError(msg=f"{dest} announced no CURVE key, and this sender encrypts KV")
            sock = self.ctx.socket(zmq.DEALER)
            if self.curve is not None:
                sock.curve_publickey, sock.curve_secretkey = self.curve
                sock.curve_serverkey = peer_key.encode()
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.setsockopt(zmq.RCVHWM, self.hwm)
            sock.setsockopt(zmq.LINGER, 0)
            self.monitors[dest] = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(dest if "://" in dest else f"tcp://{dest}")
            self.sockets[dest] = sock
            self._poller = None
        return sock

    def wait(self, timeout_s: float) -> None:
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self._wake_r, zmq.POLLIN)
            for sock in self.sockets.values():
                self._poller.register(sock, zmq.POLLIN)
        if self._poller.poll(max(int(timeout_s * 1000), 0)):
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def send(self, dest: str, header: KVHeader, frames: Sequence[memoryview], timeout_s: float,
             key: bytes | None = None, peer_key: str = "") -> TransferHandle:
        handle = TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)
        header.transfer_id = f"{header.request_id}#{next(self._ids)}"
        handle.transfer_id = header.transfer_id
        tid = header.transfer_id.encode()
        try:
            sock = self._socket(dest, peer_key)
            sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 1))
            refs, frames = self._references(dest, header, frames)
            raw = header.encode()
            opening = [HEADER, raw, header_tag(key, raw)]
            # One message per frame, each with its own checksum (and tag) computed just before it
            # goes out: hashing frame i+1 overlaps ZeroMQ's I/O thread putting frame i on the wire.
            for i, frame in enumerate(frames):
                digest = header.frames[i].checksum or checksum(frame)
                header.frames[i].checksum = digest
                parts = [_INDEX.pack(i, digest), frame_tag(key, header.transfer_id, i, digest),
                         refs[i] if refs else frame]
                sock.send_multipart([*opening, *parts] if i == 0 else [FRAME, tid, *parts], copy=False)
            if not frames:
                sock.send_multipart(opening, copy=False)
        except zmq.Again:
            handle.advance(TransferState.FAILED, f"send to {dest} timed out (peer not draining)")
            self._drop_socket(dest)
            return handle
        except zmq.ZMQError as e:
            handle.advance(TransferState.FAILED, f"send to {dest} failed: {e}")
            self._drop_socket(dest)
            return handle
        handle.advance(TransferState.SENT)
        if refs:
            self.bytes_by_reference += header.total_bytes
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
                    if "shm" in ack and self.peer_maps.get(handle.dest) is not bool(ack["shm"]):
                        self.peer_maps[handle.dest] = bool(ack["shm"])
                        self.num_shared_peers = sum(self.peer_maps.values())
                        log.info("KV to %s goes %s", handle.dest, "through shared memory" if ack["shm"]
                                 else "over the socket (the receiver cannot map this sender's memory)")
                    ok = bool(ack.get("ok"))
                    handle.advance(TransferState.DONE if ok else TransferState.FAILED, ack.get("err", ""))
        now = time.monotonic()
        for key, handle in list(self.open.items()):
            if key not in self.open:
                continue  # settled above by _drop_socket, with the other transfers to its peer
            if handle.done:
                self.open.pop(key)
            elif now > handle.deadline:
                handle.advance(TransferState.FAILED, f"no acknowledgement from {handle.dest} before the timeout")
                self.open.pop(key)
                self._drop_socket(handle.dest)  # a silent peer: connect afresh (or never) next time
        busy = {h.dest for h in self.open.values()}
        for dest, used in list(self.last_used.items()):
            if dest not in busy and (now - used > IDLE_SOCKET_S or self._disconnected(dest)):
                self._drop_socket(dest)

    def _disconnected(self, dest: str) -> bool:
        """Whether the peer's connection dropped (and has not come back) since the last look."""
        mon, gone = self.monitors.get(dest), False
        while mon is not None:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            gone = event == zmq.EVENT_DISCONNECTED
        return gone

    def _drop_socket(self, dest: str) -> None:
        """Close the socket to a peer: pending transfers to it are failed first (the caller's own
        transfer already is), so nothing waits on a socket that no longer exists."""
        for key, handle in list(self.open.items()):
            if handle.dest == dest:
                handle.advance(TransferState.FAILED, f"connection to {dest} closed")
                self.open.pop(key)
        sock, mon = self.sockets.pop(dest, None), self.monitors.pop(dest, None)
        self.last_used.pop(dest, None)
        self.peer_maps.pop(dest, None)  # a new connection may lead to a new receiver: ask again
        self.num_shared_peers = sum(self.peer_maps.values())
        self._poller = None
        if sock is not None:
            sock.disable_monitor()
            sock.close(linger=0)
        if mon is not None:
            mon.close(linger=0)

    @property
    def num_sockets(self) -> int:
        return len(self.sockets)

    def abandon(self, handle: TransferHandle) -> None:
        super().abandon(handle)
        self.open.pop(handle.transfer_id, None)

    def close(self) -> None:
        for dest in list(self.sockets):
            self._drop_socket(dest)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._own_ctx:
            self.ctx.term()


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
        if len(parts[0].bytes) != _INDEX.size:
            self._queue_ack(ident, tid.decode(errors="replace"), False, "malformed transfer message")
            return None
        index, digest = _INDEX.unpack(parts[0].bytes)
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
