"""A KVSender on a thread of its own.

Callers on an event loop hand a transfer over and wait on a future; the thread sends it (the
per-frame hashing runs there, off the caller's loop), then sleeps in `KVSender.wait` until an
acknowledgement, a new transfer or the next deadline wakes it. Nothing polls on a timer: an
acknowledged transfer's future resolves within one wake-up, where the old caller-side loop slept
up to 5 ms between looks. The thread is the sender's only user, so transports stay
single-threaded."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from transfer.base import KVSender, TransferHandle, TransferState
from transfer.wire import KVHeader

log = logging.getLogger(__name__)
TIDY_S = 1.0  # an idle sender still looks this often: socket idle timeouts, vanished peers


class SenderLoop:
    def __init__(self, sender: KVSender, name: str = "kv-sender", on_start: Callable[[], None] | None = None) -> None:
        """`on_start` runs first on the thread (a worker lowers its priority there: the engine's
        threads come first)."""
        self.sender = sender  # read by the thread on every turn
        self._on_start = on_start
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._open: dict[int, tuple[TransferHandle, Future]] = {}  # id(future) -> its transfer
        self._queued: dict[int, tuple[TransferHandle, Future]] = {}  # handed over, not yet sent
        self._lock = threading.Lock()  # send() against close(): nothing queued after the thread ends
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, dest: str, header: KVHeader, frames: Sequence[memoryview], timeout_s: float,
             key: bytes | None = None, peer_key: str = "") -> Future[TransferHandle]:
        """Queue a transfer; the future resolves with its handle once DONE or FAILED (never
        raises: a failure is the handle's state). The frames must stay valid until then."""
        fut: Future[TransferHandle] = Future()
        # Stands in for the transport's handle until the thread sends: what close() fails.
        placeholder = TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)

        def start() -> None:
            if self._queued.pop(id(fut), None) is None:
                return  # abandoned before it was sent
            try:
                handle = self.sender.send(dest, header, frames, timeout_s, key=key, peer_key=peer_key)
            except Exception as e:  # a transport bug must not end the thread: fail this transfer
                handle = placeholder
                handle.advance(TransferState.FAILED, f"send failed: {e}")
            self._open[id(fut)] = (handle, fut)

        with self._lock:
            if self._stop.is_set():
                placeholder.advance(TransferState.FAILED, "sender closed")
                fut.set_result(placeholder)
                return fut
            self._queued[id(fut)] = (placeholder, fut)
            self._submit(start)
        return fut

    def abandon(self, fut: Future[TransferHandle]) -> None:
        """The caller stopped waiting (its request was cancelled): stop tracking the transfer."""
        def drop() -> None:
            self._queued.pop(id(fut), None)
            entry = self._open.pop(id(fut), None)
            if entry is not None:
                self.sender.abandon(entry[0])
            fut.cancel()

        self._submit(drop)

    def _submit(self, cmd: Callable[[], None]) -> None:
        self._cmds.put(cmd)
        self.sender.wake()

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while not self._stop.is_set():
            try:
                while True:
                    self._cmds.get_nowait()()
            except queue.Empty:
                pass
            try:
                self.sender.poll()
            except Exception:
                log.exception("KV sender poll failed")
            self._settle()
            self.sender.wait(self._timeout())

    def _settle(self) -> None:
        """Resolve finished transfers; fail any past its deadline (even one the transport lost)."""
        now = time.monotonic()
        for key, (handle, fut) in list(self._open.items()):
            handle.expire(now)
            if handle.done:
                del self._open[key]
                if not fut.done():
                    fut.set_result(handle)

    def _timeout(self) -> float:
        now = time.monotonic()
        deadlines = [h.deadline - now for h, _ in self._open.values()]
        return max(min([TIDY_S, *deadlines]), 0.0) + 0.001

    @property
    def in_flight(self) -> int:
        """Transfers handed over and not yet finished (queued or on the wire)."""
        return len(self._queued) + len(self._open)

    def close(self) -> None:
        """Stop the thread; transfers still open are failed, so no waiter hangs."""
        with self._lock:
            self._stop.set()
        self.sender.wake()
        self._thread.join(timeout=5)
        for handle, fut in [*self._queued.values(), *self._open.values()]:
            handle.advance(TransferState.FAILED, "sender closed")
            if not fut.done():
                fut.set_result(handle)
        self._queued.clear()
        self._open.clear()
