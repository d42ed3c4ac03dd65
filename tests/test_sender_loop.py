"""SenderLoop: a KVSender on its own thread that sleeps until an acknowledgement, a new
transfer or a deadline wakes it (issue 10: no polling loops on the KV path)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.test_transfer import make_payload
from transfer import SenderLoop, TransferHandle, TransferState, make_receiver, make_sender, verify


class Counting:
    """Delegates to a real sender and counts how often the loop looks at it."""

    def __init__(self, inner) -> None:
        self.inner, self.polls = inner, 0

    def poll(self) -> None:
        self.polls += 1
        self.inner.poll()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _ack_late(rx, stop, delay_s: float) -> None:
    while not stop.is_set():
        for item in rx.poll(0.02):
            time.sleep(delay_s)  # a slow receiver: the sender has nothing to do meanwhile
            verify(item.header, item.frames) if not item.landed else None
            item.ack(True)


@pytest.mark.parametrize("transport", ["zmq", "grpc", "fake"])
def test_a_waiting_sender_sleeps_until_the_ack(transport):
    rx = make_receiver(transport, host="127.0.0.1")
    sender = Counting(make_sender(transport))
    loop = SenderLoop(sender)
    stop = threading.Event()
    t = threading.Thread(target=_ack_late, args=(rx, stop, 0.5), daemon=True)
    t.start()
    try:
        header, frames = make_payload()
        handle = loop.send(rx.address, header, frames, timeout_s=10).result(timeout=10)
        assert handle.state is TransferState.DONE, handle.error
        # Half a second of waiting took a handful of looks; a sleep-and-look loop (the old
        # 0.2-5 ms backoff) takes over a hundred.
        assert sender.polls < 10
    finally:
        stop.set()
        t.join()
        loop.close()
        sender.close()
        rx.close()


class Losing:
    """Accepts a transfer and loses it: its handle never advances by itself."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def send(self, dest, header, frames, timeout_s, **kw):
        return TransferHandle(header.request_id, dest, header.total_bytes, time.monotonic() + timeout_s)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_lost_transfer_fails_at_its_deadline():
    loop = SenderLoop(Losing(make_sender("fake")))
    try:
        header, frames = make_payload()
        t0 = time.monotonic()
        handle = loop.send("fake://nowhere", header, frames, timeout_s=0.3).result(timeout=5)
        assert handle.state is TransferState.FAILED and "before the timeout" in handle.error
        assert time.monotonic() - t0 >= 0.3 and loop.in_flight == 0
    finally:
        loop.close()


def test_close_fails_what_is_open_and_refuses_more():
    sender = Losing(make_sender("fake"))
    loop = SenderLoop(sender)
    header, frames = make_payload()
    fut = loop.send("fake://nowhere", header, frames, timeout_s=60)
    time.sleep(0.05)
    loop.close()
    assert fut.result(timeout=1).state is TransferState.FAILED  # nobody is left waiting
    late = loop.send("fake://nowhere", header, frames, timeout_s=60)
    assert late.result(timeout=1).state is TransferState.FAILED and "closed" in late.result().error


def test_abandon_stops_tracking_the_transfer():
    sender = make_sender("fake")
    loop = SenderLoop(Losing(sender))
    try:
        header, frames = make_payload()
        fut = loop.send("fake://nowhere", header, frames, timeout_s=60)
        loop.abandon(fut)
        end = time.monotonic() + 5
        while loop.in_flight and time.monotonic() < end:
            time.sleep(0.01)
        assert fut.cancelled() and loop.in_flight == 0
    finally:
        loop.close()


def test_on_start_runs_first_on_the_senders_thread():
    """Where a worker lowers the thread's priority (the engine's threads come first)."""
    seen = []
    loop = SenderLoop(make_sender("fake"), name="kv-sender-test",
                      on_start=lambda: seen.append(threading.current_thread().name))
    try:
        header, frames = make_payload()
        loop.send("fake://nowhere", header, frames, timeout_s=1).result(timeout=5)
        assert seen == ["kv-sender-test"]
    finally:
        loop.close()
