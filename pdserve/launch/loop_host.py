"""Runs one async serve() in a background thread, so a Ray actor hosting it can still answer
control calls (ready, pid, shutdown) on its own thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine

from pdcommon import event_loop as loops
from pdcommon.event_loop import EventLoopKind
from pdcommon.gc_heap import freeze_startup_heap
from pdcommon.priority import lower_thread_priority, set_thread_slice


class LoopHost:
    """Runs one async serve() in a thread; `started` gets its address."""

    def __init__(self, make: Callable[[asyncio.Event, asyncio.Future], Coroutine], io_nice: int = 0,
                 event_loop: EventLoopKind = "uvloop", freeze_heap: bool = False, slice_us: int = 0) -> None:
        """`freeze_heap`: the process hosts this server until it exits (a Ray actor), so its
        start-up heap is frozen once the server is up (pdcommon/gc_heap.py). `slice_us`: the
        scheduler slice the server's threads ask for (pdcommon/priority.py; 0: the default)."""
        self._ready = threading.Event()
        self._event_loop = event_loop
        self._address = ""
        self._error: BaseException | None = None
        self._make = make
        self._io_nice = io_nice
        self._freeze_heap = freeze_heap
        self._slice_us = slice_us
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.started: asyncio.Future | None = None  # on `loop`: the serve() address, once it has one
        self._loop_ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        set_thread_slice(self._slice_us)  # the loop's threads (and a worker's engine thread) inherit it

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            started = self.started = self.loop.create_future()
            started.add_done_callback(self._on_started)
            self._loop_ready.set()
            try:
                await self._make(self.stop_event, started)
            except BaseException as e:
                self._error = e
                if not started.done():
                    started.set_exception(e)
                self._ready.set()
                raise

        try:
            loops.run(main(), self._event_loop)
        except BaseException:
            logging.getLogger(__name__).exception("server thread ended with an error")

    def _on_started(self, fut: asyncio.Future) -> None:
        # Runs on the loop thread, after the server started (and a worker's engine thread with it).
        if fut.exception() is not None:  # serve() failed: `wait` reports it
            return
        lower_thread_priority(self._io_nice)
        self._address = fut.result()
        self._ready.set()
        if self._freeze_heap:  # after readiness: its collection (~0.1 s) need not delay `ready`
            freeze_startup_heap()

    def wait_loop(self, timeout_s: float) -> asyncio.AbstractEventLoop:
        """The running loop (to submit work to before serve() has started)."""
        if not self._loop_ready.wait(timeout_s) or self.loop is None:
            raise TimeoutError(f"event loop did not start within {timeout_s:.0f}s")
        return self.loop

    def wait(self, timeout_s: float) -> str:
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"server did not start within {timeout_s:.0f}s")
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error!r}") from self._error
        return self._address

    def stop(self) -> None:
        if self.loop is not None and self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout=10)


def quiet_logging() -> None:
    from pdcommon.logs import setup_logging

    setup_logging()
