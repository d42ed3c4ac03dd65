"""Lanes: one long-lived bidirectional gRPC call from a sender to a receiver, carrying the KV between
them, each KV as the messages it would send on a call of its own, and each answered by one message.

Each call has a fixed cost that a lane pays once: the HTTP/2 stream and its headers, in grpcio a
thread started per client-streaming call to drain its requests, and, on a channel with no other
call open, the thread that polls its completion queue. 1 MiB raw, two processes, 300 turns each in
three runs: a message and its answer on an open bidirectional call took 0.70-0.72x the time of a
new client-streaming call (paired medians); a new unary call took about the same as the stream.

A KV of one chunk goes on the lane whenever it is open. A larger one (a bulk KV) of up to
LANE_MAX_BYTES takes it only when nothing is waiting for an answer on it, and nothing else takes
the lane until its answer is back: a bulk KV cannot be interleaved with another, and a small KV
queued behind one would wait for all of its bytes. While the lane is busy, a KV goes on a call of
its own, as before lanes. A bulk KV the sender gives up on ends the lane (it cannot be taken back
mid-way), and the next KV opens another.

The receiver reads a lane's KV on a thread of its own and hands each to its owner as it
arrives, without waiting for the previous one's acknowledgement: the owner may hold an ack for an
engine step, and the next KV lands meanwhile, as it would on a call of its own. So acks may come
back in any order; each carries the sequence number of its KV on the lane. A KV the receiver
stops reading part-way (it failed a check) ends the lane after its ack, since where the next KV
begins is lost.

A lane opens in the background: the receiver's first reply (empty) says it took the lane, and the
sender uses it from then on. A receiver refuses lanes beyond `max_lanes` (each holds one of its
gRPC threads while open) with RESOURCE_EXHAUSTED, and a sender whose lane was refused, or failed
before it opened, sends as before (a call per KV) and tries again after LANE_RETRY_S. A lane that
breaks fails the transfers on it at once (their outcome is unknown: the router's retry decides),
and the next KV opens a new one. A lane idle for LANE_IDLE_S closes (each holds a thread at either
end), and the next KV opens it again."""

from __future__ import annotations

import itertools
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
# The largest KV a lane carries. A call saves nothing beyond it: grpcio moves bytes more slowly on
# a long-lived bidirectional call than on a new client stream (raw, 64 MiB: 1.18x the time; 8 MiB:
# 0.95x). The transport, each size alternating lane and call in one process (bench/transfer.py's
# receiver): the lane took 0.94x the time at 8 MiB, 0.97-1.00x at 16, 1.02x at 32 and 64, 1.01-1.03x
# at 256 MiB.
LANE_MAX_BYTES = 16 << 20
_CANCELLED = object()


class LaneClosed(Exception):
    """The receiver ended the lane with transfers still unanswered on it."""


class SenderLane:
    """The sender's end: `send` returns a future of the ack bytes, or None while the lane cannot
    take the KV (not open yet, failed, or busy with a bulk KV). Any thread may send; one thread
    reads the replies."""

    def __init__(self, call: grpc.StreamStreamMultiCallable, dest: str) -> None:
        self.dest = dest
        self.ready = False  # the receiver took the lane
        self.dead = False
        self.last_send = time.monotonic()
        self._lock = threading.Lock()  # send against the reader failing the lane
        self._waiting: dict[int, futures.Future] = {}
        self._bulk: futures.Future | None = None  # a bulk KV on the lane, until its answer
        self._next = 0
        self._requests: queue.SimpleQueue[Iterator[bytes] | None] = queue.SimpleQueue()
        # No deadline: the lane lives until close() or an error; each transfer has its own
        # deadline, kept by the sender (transfer.SenderLoop).
        self._call = call(self._messages())
        threading.Thread(target=self._read, name="kv-grpc-lane", daemon=True).start()

    def _messages(self) -> Iterator[bytes]:
        """What grpcio's thread sends: each KV's messages in turn, made as they go out."""
        while (kv := self._requests.get()) is not None:
            yield from kv

    def send(self, messages: Iterator[bytes], bulk: bool = False) -> futures.Future | None:
        """Queue one KV's messages (`bulk`: more than one), unless the lane cannot take it now."""
        with self._lock:
            if self.dead or not self.ready or self._bulk is not None or (bulk and self._waiting):
                return None
            fut: futures.Future = futures.Future()
            fut.set_running_or_notify_cancel()  # a sent message cannot be taken back
            self._waiting[self._next] = fut
            if bulk:
                self._bulk = fut
            self._next += 1
            self.last_send = time.monotonic()
            self._requests.put(messages)  # under the lock: queued in sequence order
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
                    if fut is self._bulk:
                        self._bulk = None
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
        """The sender gave up on this KV (abandoned, or past its deadline). A bulk KV may still
        be going out: the lane ends, which stops it (nothing else is on the lane meanwhile)."""
        with self._lock:
            self._waiting = {seq: f for seq, f in self._waiting.items() if f is not fut}
            bulk = fut is self._bulk
        if bulk:
            self.close()

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
    """The receiver's end. `receive(messages, reply)` reads one KV from `messages` (its first,
    then the lane's), hands it over, calls `reply(ack)` once, from any thread, when its owner has
    answered, and returns whether it read exactly that KV's messages (the lane then goes on)."""

    def __init__(self, receive: Callable[[Iterator[bytes], Callable[[bytes], None]], bool],
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
                        whole = self.receive(itertools.chain((message,), request_iterator), reply)
                    except Exception as e:  # this KV fails, and where the next begins is unknown
                        log.exception("KV lane: a transfer failed on the receiver")
                        reply(ack_message("", False, f"receiver error: {e}"))
                        whole = False
                    if not whole:
                        break
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
