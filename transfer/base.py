"""Transport-neutral sender/receiver interfaces.

A send returns a handle whose state only moves forward: PENDING -> SENT -> DONE, or to FAILED
from any state; FAILED and DONE are final. `poll()` never blocks.
"""

from __future__ import annotations

import abc
import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from transfer.wire import KVHeader


class TransferState(enum.IntEnum):
    PENDING = 0
    SENT = 1
    DONE = 2
    FAILED = 3


@dataclass(slots=True)
class TransferHandle:
    request_id: str
    dest: str
    nbytes: int
    deadline: float
    state: TransferState = TransferState.PENDING
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    transfer_id: str = ""

    def advance(self, state: TransferState, error: str = "") -> None:
        """Move forward only; DONE and FAILED are sticky."""
        if self.state in (TransferState.DONE, TransferState.FAILED) or state <= self.state:
            return
        self.state = state
        if state is TransferState.FAILED:
            self.error = error or "transfer failed"
        if state in (TransferState.DONE, TransferState.FAILED):
            self.finished = time.monotonic()

    @property
    def done(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    def expire(self, now: float) -> bool:
        """Fail a transfer still open past its deadline (no acknowledgement came); whether it did."""
        if self.done or now <= self.deadline:
            return False
        self.advance(TransferState.FAILED, f"no acknowledgement from {self.dest} before the timeout")
        return True

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started


@dataclass(slots=True)
class ReceivedKV:
    """An incoming transfer: header and frames. The owner checks it, lands the blocks, then
    calls `ack` exactly once so the sender learns the outcome."""

    header: KVHeader
    frames: list[memoryview]
    _ack: Callable[[bool, str], None]
    acked: bool = False
    # True when a streaming receiver already checked and handed every frame to its sink
    # (then `frames` is empty); an `error` is the first check that failed on the way.
    landed: bool = False
    error: str = ""

    def ack(self, ok: bool, error: str = "") -> None:
        if not self.acked:
            self.acked = True
            self._ack(ok, error)


class KVSink(Protocol):
    """Lets a streaming receiver hand over frames as they arrive (checks and copies overlap
    the wire). Either method raises TransferError to refuse the transfer."""

    def open(self, header: KVHeader) -> None: ...

    def frame(self, header: KVHeader, index: int, buf: memoryview) -> None: ...


class KVSender(abc.ABC):
    def __init__(self) -> None:
        self._wakeup = threading.Event()

    @abc.abstractmethod
    def send(self, dest: str, header: KVHeader, frames: Sequence[memoryview], timeout_s: float,
             key: bytes | None = None, peer_key: str = "") -> TransferHandle:
        """Start a transfer; the frames must stay valid until the handle is done. `key`: the
        reservation's transfer key, which signs header and frames (see wire.header_tag); `peer_key`:
        the receiver's public key when the transport encrypts (ZeroMQ CURVE)."""

    @abc.abstractmethod
    def poll(self) -> None:
        """Advance every open handle without blocking (acks, errors, timeouts)."""

    def share(self, fd: int, memory: memoryview) -> bool:
        """Offer `memory` (mapped from the memfd `fd`; a worker's KV pool) to receivers on this
        host: frames inside it may then travel by reference (transfer/shared_memory.py). Call
        before the first send. False where the transport or the memory cannot."""
        return False

    def abandon(self, handle: TransferHandle) -> None:
        """The caller no longer waits for this transfer (its request was cancelled)."""
        handle.advance(TransferState.FAILED, "abandoned by the sender")

    def wait(self, timeout_s: float) -> None:
        """Block until `poll()` may have something to advance, `wake()` is called, or timeout_s
        passes: what lets a sender thread sleep instead of polling. Transports whose acks come as
        callbacks call `wake()` from them; socket transports override this with a real wait."""
        self._wakeup.wait(timeout_s)
        self._wakeup.clear()

    def wake(self) -> None:
        """End a `wait()` now (any thread)."""
        self._wakeup.set()

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    address: str

    @abc.abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[ReceivedKV]:
        """Transfers that arrived; waits at most timeout_s for the first one."""

    @abc.abstractmethod
    def close(self) -> None: ...


def drain(q: queue.Queue, timeout_s: float) -> list:
    """Everything queued now, waiting at most timeout_s for the first item."""
    out = []
    try:
        out.append(q.get(timeout=timeout_s) if timeout_s > 0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        pass
    return out
