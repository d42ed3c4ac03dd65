"""One thread owns the engine; asyncio handlers talk to it through commands and per-request
output queues. Every engine call runs on that thread, except LLMEngine.land_kv, which the
decode worker's receiver thread calls (see the threading rule in engine/llm_engine.py)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._stop = threading.Event()
        self.stats = engine.stats()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run fn(*args) on the engine thread; await the returned future for its result."""
        fut = self.loop.create_future()

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as e:  # handed back to the awaiting handler
                self.loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self.loop.call_soon_threadsafe(_set_result, fut, result)

        self._cmds.put(run)
        return fut

    def submit(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread between steps; nobody waits for it (callable from any thread)."""
        def run() -> None:
            try:
                fn()
            except Exception:  # nobody awaits it: log, and keep the engine thread alive
                log.exception("engine-thread task failed")

        self._cmds.put(run)

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str, q: asyncio.Queue[RequestOutput]) -> None:
        """Stop delivering to q; a newer stream opened under the same id (a retry) stays."""
        if self._streams.get(request_id) is q:
            del self._streams[request_id]

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                # Idle: sleep until a command comes. Busy: take what is queued, then step.
                cmd = self._cmds.get_nowait() if eng.has_unfinished() else self._cmds.get()
                cmd()
                while True:
                    self._cmds.get_nowait()()
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                self.stats = eng.stats()
                continue
            try:
                outputs = eng.step()
            except Exception:
                log.exception("engine step failed")
                raise
            self.steps += 1
            self.stats = eng.stats()
            if outputs:
                self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        self._thread.join(timeout=5)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
