"""Decode tokens straight from a worker's engine thread to the router, over ZeroMQ.

Why: on the gRPC stream every token woke the decode worker's event loop, built a protobuf and
went through gRPC's asyncio machinery, all under the GIL the engine thread needs for its own
step. Measured on stories260K (1 prefill + 1 decode): the stream's ITL was twice the engine's
step alone. Here the engine thread packs each output (msgpack, a keyed BLAKE2b tag) and sends
one ZeroMQ message per step to each router, whatever the number of streams: no event loop in
the worker is involved per token. The router's PULL socket is read from its event loop's selector.

What still rides the gRPC Decode stream: the reservation, the KV transfer's figures (ahead of the
first decoded token, which comes direct), the last message (with the finish reason) and any
error, so cancellation, disconnects and failover work as before. Every token message carries the
index of its first token in the stream, and the router puts both channels back in order.

The first token of a prompt prefilled on the decoding worker (colocated, or a short prompt) comes
direct too, at index FIRST with the prefill's figures, unless it ends the stream. On the event
loop it waited behind the next decode step, which starts at once and takes every core: over HTTP
on a colocated 50M-model worker it reached the router 1.5-5 ms after its step.

A message is accepted only for an open stream and only with that stream's key, which the router
made for this attempt and gave the worker over the authenticated control channel. Tokens cross the
network in clear text, as KV does over ZeroMQ; under mutual TLS the router does not ask for this
path and tokens stay on the (encrypted) gRPC stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from dataclasses import dataclass, field

import msgpack
import zmq

_TAG = 16
# The index of the first token of a prompt prefilled where it is decoded: apart from the stream's
# count, which starts at the token after it (as when the first token came from a prefill worker).
FIRST = -1


def _tag(key: bytes, head: bytes) -> bytes:
    return hashlib.blake2b(head, key=key, digest_size=_TAG, person=b"pdserve-tokens").digest()


@dataclass(slots=True)
class TokenChunk:
    """Consecutive tokens of one stream, from its index-th token on."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    # What only the gRPC stream's messages carry (the last, the first after a transfer): read
    # alike from either kind of chunk.
    finish_reason: str = ""
    top_logprobs: tuple = ()
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    decode_batch: float = 0.0
    # The FIRST chunk's prefill figures (FirstToken's).
    prefill_s: float = 0.0
    cached_tokens: int = 0
    # ... and its prompt logprobs, when asked for (only ever on the gRPC stream).
    prompt_logprobs: tuple = ()
    prompt_top_logprobs: tuple = ()


def pack(request_id: str, attempt: int, key: bytes, chunk: TokenChunk) -> list[bytes]:
    """One stream's chunk and its tag: two frames of a message that may carry several streams'."""
    fields = [request_id, attempt, chunk.index, chunk.token_ids, chunk.text, chunk.logprobs]
    if chunk.index == FIRST:
        fields += [chunk.prefill_s, chunk.cached_tokens]
    head = msgpack.packb(fields)
    return [head, _tag(key, head)]


class InOrder:
    """Puts a stream's chunks back in order by index (the two channels race); a chunk whose index
    was already passed (a duplicate) is dropped."""

    def __init__(self, start: int = 0) -> None:
        self.expected = start
        self._ahead: dict = {}

    def push(self, chunk) -> list:
        """The chunks now ready, in order (`chunk` has .index and .token_ids)."""
        if chunk.index >= self.expected:
            self._ahead.setdefault(chunk.index, chunk)
        ready = []
        while self.expected in self._ahead:
            c = self._ahead.pop(self.expected)
            ready.append(c)
            if not c.token_ids:  # only a finish can be empty; nothing may follow it
                break
            self.expected += len(c.token_ids)
        return ready

    @property
    def waiting(self) -> int:
        return len(self._ahead)


class TokenPusher:
    """The worker's side: one PUSH socket per router endpoint. Not thread-safe: the engine thread
    owns it and is the only caller."""

    def __init__(self, hwm: int = 100_000) -> None:
        # A context of its own, whose I/O thread (which puts each token on the wire) starts here,
        # with the first socket, on the serving thread that builds the pusher: it inherits that
        # thread's short scheduler slice (pdcommon/priority.py), where one the engine thread
        # started would have the engine's, and wait up to a tick for a core after each step.
        self._ctx = zmq.Context()
        self._ctx.socket(zmq.PUSH).close(0)
        self._socks: dict[str, zmq.Socket] = {}
        self._hwm = hwm

    def send(self, endpoint: str, frames: list[bytes]) -> bool:
        """Queue frames for the router; False when they cannot go now (router gone, queue full):
        the caller then sends them on the gRPC stream instead."""
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._socks[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            sock.setsockopt(zmq.LINGER, 0)
            # Queue only on a live connection: a token port this worker cannot reach (a firewall, a
            # router gone) must not swallow tokens until the stall timeout; they go by gRPC instead.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(endpoint)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self._ctx.term()


@dataclass(slots=True)
class _Stream:
    key: bytes
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class TokenInbox:
    """The router's side: a PULL socket bound on the control host, read from the event loop's
    selector (no thread, no task per message). Messages go to the queue of their open stream."""

    def __init__(self, host: str, port: int) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # the router reads as fast as it can; never drop
        bind_host = "*" if host in ("0.0.0.0", "::") else host
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self._streams: dict[tuple[str, int], _Stream] = {}
        self.received = 0
        self.refused = 0  # unknown stream, bad tag or malformed: counted, never delivered
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)
        self._drain()  # the FD is edge-triggered: take what came before we listened

    def open(self, request_id: str, attempt: int, key: bytes) -> asyncio.Queue:
        stream = self._streams[(request_id, attempt)] = _Stream(key)
        return stream.queue

    def close_stream(self, request_id: str, attempt: int) -> None:
        self._streams.pop((request_id, attempt), None)

    def _drain(self) -> None:
        sock = self._sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._deliver(frames)

    def _deliver(self, frames: list[bytes]) -> None:
        """A message is (chunk, tag) pairs, one per stream the engine stepped: each pair is
        checked against its own stream's key."""
        if len(frames) % 2:
            self.refused += 1
            return
        for head, tag in zip(frames[::2], frames[1::2], strict=True):
            try:
                rid, attempt, index, ids, text, lps, *figures = msgpack.unpackb(head)
                chunk = TokenChunk(index, ids, text, lps)
                if index == FIRST:
                    chunk.prefill_s, chunk.cached_tokens = figures
                stream = self._streams.get((rid, attempt))
                ok = stream is not None and hmac.compare_digest(_tag(stream.key, head), tag)
            except (ValueError, TypeError, msgpack.UnpackException):
                ok = False
            if not ok:
                self.refused += 1
                continue
            self.received += 1
            stream.queue.put_nowait(chunk)

    def close(self) -> None:
        if self._sock.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        self._sock.close(0)
