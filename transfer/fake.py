"""In-process transport for unit tests: same interfaces, no sockets."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Sequence

from transfer.base import KVReceiver, KVSender, ReceivedKV, TransferHandle, TransferState, drain
from transfer.wire import KeyLookup, KVHeader, TransferError, authorize, fill_checksums, header_tag

_RECEIVERS: dict[str, FakeReceiver] = {}
_ids = itertools.count()


class FakeReceiver(KVReceiver):
    def __init__(self, *_, keys: KeyLookup | None = None, **__) -> None:
        self.keys = keys
        self.address = f"fake://{next(_ids)}"
        self.queue: queue.Queue[ReceivedKV] = queue.Queue()
        _RECEIVERS[self.address] = self

    def poll(self, timeout_s: float = 0.0) -> list[ReceivedKV]:
        return drain(self.queue, timeout_s)

    def close(self) -> None:
        _RECEIVERS.pop(self.address, None)


class FakeSender(KVSender):
    def __init__(self, *_, **__) -> None:
        super().__init__()
        self.open: list[TransferHandle] = []

    def send(self, dest: str, header: KVHeader, frames: Sequence[memoryview], timeout_s: float,
             key: bytes | None = None, peer_key: str = "") -> TransferHandle:
        handle = TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)
        fill_checksums(header, frames)
        rx = _RECEIVERS.get(dest)
        if rx is None:
            handle.advance(TransferState.FAILED, f"no receiver at {dest}")
            return handle

        def ack(ok: bool, err: str) -> None:
            handle.advance(TransferState.DONE if ok else TransferState.FAILED, err)
            self.wake()

        raw = header.encode()
        received = KVHeader.decode(raw)
        try:
            authorize(rx.keys, received, raw, header_tag(key, raw))
        except TransferError as e:
            handle.advance(TransferState.FAILED, str(e))
            return handle
        # Copy like a real wire would: the receiver must not alias the sender's pool.
        rx.queue.put(ReceivedKV(received, [memoryview(bytes(f)) for f in frames], ack))
        handle.advance(TransferState.SENT)
        self.open.append(handle)
        return handle

    def poll(self) -> None:
        now = time.monotonic()
        for h in self.open:
            if not h.done and now > h.deadline:
                h.advance(TransferState.FAILED, "timed out")
        self.open = [h for h in self.open if not h.done]

    def close(self) -> None:
        self.open.clear()
