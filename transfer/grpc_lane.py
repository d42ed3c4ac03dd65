"""Lanes: one long-lived bidirectional gRPC call from a sender to a receiver, carrying every KV of
one chunk between them as one message each way.

Each call has a fixed cost that a lane pays once: the HTTP/2 stream and its headers, and in
grpcio a thread started per client-streaming call to drain its requests. 1 MiB raw, two
processes, 300 turns each in three runs: a message and its answer on an open bidirectional call
took 0.70-0.72x the time of a new client-streaming call (paired medians); a new unary call took
about the same as the stream.

The receiver reads a lane's messages on a thread of its own and hands each to its owner as it
arrives, without waiting for the previous one's acknowledgement: the owner may hold an ack for an
engine step, and the next KV lands meanwhile, as it would on a call of its own. So acks may come
back in any order; each carries the sequence number of its message on the lane.

A lane opens in the background: the receiver's first reply (empty) says it took the lane, and the
sender uses it from then on. A receiver refuses lanes beyond `max_lanes` (each holds one of its
gRPC threads while open) with RESOURCE_EXHAUSTED, and a sender whose lane was refused, or failed
before it opened, sends as before (a call per KV) and tries again after LANE_RETRY_S. A lane that
breaks fails the transfers on it at once (their outcome is unknown: the router's retry decides),
and the next KV opens a new one. A lane idle for LANE_IDLE_S closes (each holds a thread at either
end), and the next KV opens it again."""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import msgpack

log = logging.getLogger(__name__)
_SEQ = struct.Struct("<Q")  # before each ack on a lane: the sequence number of its message
LANE_RETRY_S = 30.0  # after a refused (or never opened) lane, calls per KV for this long
MAX_LANES = 32  # lanes one receiver serves at once (a gRPC server thread each)
LANE_IDLE_S = 60.0  # a lane with nothing sent for this long is closed (two threads at each end)
_CANCELLED = object()


class LaneClosed(Exception):
    """The receiver ended the lane with transfers still unanswered on it."""


class SenderLane:
    """The sender's end: `send` returns a future of the ack bytes, or None until the lane is open
    (or once it has failed). Any thread may send; one thread reads the replies."""

    def __init__(self, call: grpc.StreamStreamMultiCallable, dest: str) -> None:
        self.dest = dest
        self.ready = False  # the receiver took the lane
        self.dead = False
        self.last_send = time.monotonic()
        self._lock = threading.Lock()  # send against the reader failing the lane
        self._waiting: dict[int, futures.Future] = {}
        self._next = 0
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        # No deadline: the lane lives until close() or an error; each transfer has its own
        # deadline, kept by the sender (transfer.SenderLoop).
        self._call = call(iter(self._requests.get, None))
        threading.Thread(target=self._read, name="kv-grpc-lane", daemon=True).start()

    def send(self, message: bytes) -> futures.Future | None:
        with self._lock:
            if self.dead or not self.ready:
                return None
            fut: futures.Future = futures.Future()
            fut.set_running_or_notify_cancel()  # a sent message cannot be taken back
            self._waiting[self._next] = fut
            self._next += 1
            self.last_send = time.monotonic()
            self._requests.put(message)  # under the lock: queued in sequence order
        return fut

    def _read(self) -> None:
        error: Exception = LaneClosed(f"the receiver at {self.dest} closed the lane")
        try:
            for reply in self._call:
                if not reply:
                    self.ready = True  # the receiver's greeting
                    continue
                (seq,) = _SEQ.unpack_from(reply)
                with self._lock:
                    fut = self._waiting.pop(seq, None)
                if fut is not None:
                    fut.set_result(reply[_SEQ.size:])
        except grpc.RpcError as e:
            error = e
        except Exception as e:  # a malformed reply: the lane cannot be trusted any more
            log.warning("KV lane to %s: bad reply: %s", self.dest, e)
            error = e
        with self._lock:
            self.dead = True
            waiting, self._waiting = list(self._waiting.values()), {}
        self._requests.put(None)  # ends grpc's thread that drains the requests
        self._call.cancel()  # after a bad reply the call is still open
        for fut in waiting:
            fut.set_exception(error)

    def forget(self, fut: futures.Future) -> None:
        """The sender gave up on this KV (abandoned, or past its deadline)."""
        with self._lock:
            self._waiting = {seq: f for seq, f in self._waiting.items() if f is not fut}

    def idle(self, idle_s: float) -> bool:
        """Nothing sent for `idle_s` and nothing waiting for an answer."""
        with self._lock:
            return not self._waiting and time.monotonic() - self.last_send > idle_s

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


def ack_message(rid: str, ok: bool, err: str) -> bytes:
    """The receiver's reply to one KV (msgpack), on a lane or on a call of its own, as the sender
    reads it (GrpcSender.poll)."""
    return msgpack.packb({"rid": rid, "ok": ok, "err": err})


class LaneServer:
    """The receiver's end. `receive(messages, reply)` reads one transfer from `messages`, hands it
    over, and calls `reply(ack)` once, from any thread, when its owner has answered."""

    def __init__(self, receive: Callable[[Iterator[bytes], Callable[[bytes], None]], None],
                 max_lanes: int = MAX_LANES) -> None:
        self.receive, self.max_lanes = receive, max_lanes
        self._lock = threading.Lock()
        self.open = 0
        self.refused = 0  # lanes turned away (their senders call per transfer for a while)

    def serve(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        with self._lock:
            taken = self.open < self.max_lanes
            self.open += taken
            self.refused += not taken
        if not taken:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this receiver serves {self.max_lanes} lanes at most; call per transfer")
        try:
            yield from self._lane(request_iterator, context)
        finally:
            with self._lock:
                self.open -= 1

    def _lane(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        replies: queue.SimpleQueue = queue.SimpleQueue()
        if not context.add_callback(lambda: replies.put(_CANCELLED)):  # the call ended: stop waiting
            return  # it ended already: nobody would wake this thread

        def read() -> None:
            n = 0
            try:
                for message in request_iterator:
                    seq, n = n, n + 1

                    def reply(ack: bytes, seq: int = seq) -> None:
                        replies.put(_SEQ.pack(seq) + ack)

                    try:
                        self.receive(iter((message,)), reply)
                    except Exception as e:  # this KV fails; the lane and the KV behind it go on
                        log.exception("KV lane: a transfer failed on the receiver")
                        reply(ack_message("", False, f"receiver error: {e}"))
            except Exception as e:  # the call was cancelled or broke: the callback ends the lane
                log.debug("KV lane read ended: %s", e)
            replies.put(n)  # how many acks the lane owes before it may end

        threading.Thread(target=read, name="kv-grpc-lane-read", daemon=True).start()
        yield b""  # the greeting: the sender may use the lane
        answered, owed = 0, None
        while owed is None or answered < owed:
            item = replies.get()
            if item is _CANCELLED:
                return
            if isinstance(item, int):
                owed = item
                continue
            answered += 1
            yield item
