"""The ZeroMQ transport's sending end: a DEALER socket per receiver, one message per frame, each
hashed just before it goes out, and acknowledgements read back on the same socket (the message
format: transfer/zmq_transport.py)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from transfer.base import KVSender, TransferHandle, TransferState
from transfer.shared_memory import SharedRegion, cut_frames
from transfer.wire import KVHeader, checksum, frame_tag, header_tag
from transfer.zmq_transport import DEFAULT_HWM, FRAME, HEADER, INDEX

IDLE_SOCKET_S = 60.0  # a sender closes its socket to a peer unused this long (or whose transfer failed)
log = logging.getLogger(__name__)


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
                parts = [INDEX.pack(i, digest), frame_tag(key, header.transfer_id, i, digest),
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
            elif handle.expire(now):
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
