"""The gRPC transport's sending end: a KV per call, or on a lane kept open to its receiver
(transfer/grpc_lane.py); the message format is transfer/grpc_transport.py's."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from concurrent import futures

import grpc
import msgpack

from transfer.base import KVSender, TransferHandle, TransferState
from transfer.grpc_lane import LANE_IDLE_S, LANE_MAX_BYTES, LANE_RETRY_S, SenderLane
from transfer.grpc_transport import METHOD, METHOD_LANE, OPTIONS, kv_messages, messages_after_opening
from transfer.wire import KVHeader


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
        self.credentials, self.options = channel_credentials, [*OPTIONS, *(channel_options or [])]
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
        messages, bulk = kv_messages(header, frames, key), messages_after_opening(header) > 0
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
        still, now = [], time.monotonic()
        for handle, fut in self.open:
            if not fut.done():
                handle.expire(now)  # a call has grpcio's deadline too; a KV on a lane has only this one
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
