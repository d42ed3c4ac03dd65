"""One thread owns the engine; asyncio handlers talk to it through commands and per-request
output queues. Every engine call runs on that thread, except LLMEngine.land_kv, which the
decode worker's receiver thread calls (see the threading rule in engine/llm_engine.py).

The thread also builds the engine. libgomp gives every thread that opens an OpenMP region a team
of its own, and once a process has more OpenMP threads than cores it stops spinning between
regions (it "throttles"). An engine loaded on one thread and stepped on another left two teams
behind: the 50M benchmark model's decode step took 12.1 ms against 7.1 ms on two cores, and a
served stream's inter-token time was 1.6x the engine's own step.

A stream opened with a `DirectStream` sends its outputs from the engine thread straight to the
router (pdcommon/token_stream.py); only its last output, the first one of a prompt prefilled on
this worker, and any the socket cannot take, reach the event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import LLMEngine, RequestOutput
from pdcommon.grpc_server import ServiceUnavailable
from pdcommon.priority import name_native_thread, set_thread_slice
from pdcommon.token_stream import FIRST, TokenChunk, TokenPusher, pack

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DirectStream:
    """Where a stream's outputs go (all but the last): the router's token endpoint, under this key."""

    endpoint: str
    request_id: str  # the id the router knows the stream by
    attempt: int
    key: bytes
    count_first: bool  # the first output is token 0 of the stream (False: its FirstToken, at index FIRST)
    started: bool = False
    next_index: int = 0


# A stream's items: (output, index of its first token in the stream), the index set only for a
# direct stream, whose outputs the router puts back in order.
StreamItem = tuple[RequestOutput, "int | None"]
ENGINE_THREAD_NAME = "pdserve-engine"  # the OS-level name of the engine thread and its OpenMP team
_DEAD = object()  # put on every stream once the engine has stopped: `next` raises EngineDead


class EngineDead(ServiceUnavailable):
    """The engine thread stopped on an error: nothing more runs on this worker."""


class EngineLoop:
    def __init__(self, build: Callable[[], LLMEngine], loop: asyncio.AbstractEventLoop) -> None:
        """Starts the engine thread, which first calls `build`; await `ready` for the engine (or
        the error that building it raised)."""
        self.engine: LLMEngine | None = None
        self.loop = loop
        self.ready: asyncio.Future[LLMEngine] = loop.create_future()
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._direct: dict[str, DirectStream] = {}  # read by the engine thread
        self._pusher = TokenPusher()
        self._stop = threading.Event()
        self.stats = None  # the engine's stats after the last step (EngineStats once built)
        self.steps = 0
        self.error: BaseException | None = None  # what stopped the engine thread
        self.on_death: Callable[[], None] | None = None  # called on the event loop when it stops
        self._calls: set[asyncio.Future] = set()  # call() results not in yet (event-loop thread only)
        self._thread = threading.Thread(target=self._main, args=(build,), name="engine-loop", daemon=True)
        self._thread.start()

    def _main(self, build: Callable[[], LLMEngine]) -> None:
        # Back to the kernel's default slice before the engine's OpenMP team exists (it inherits
        # it): a serving process asks a short one for its threads (pdcommon/priority.py), which
        # would let any of them take a core from a step at once, but the team must not.
        set_thread_slice(0)
        name_native_thread(ENGINE_THREAD_NAME)  # it and its OpenMP team, apart from the serving threads in `top -H`
        try:
            eng = build()
        except BaseException as e:  # the worker's start awaits `ready` and reports it
            self.loop.call_soon_threadsafe(_set_exception, self.ready, e)
            return
        self.engine, self.stats = eng, eng.stats()
        self.loop.call_soon_threadsafe(_set_result, self.ready, eng)
        self._run()

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run fn(*args) on the engine thread; await the returned future for its result."""
        fut = self.loop.create_future()
        if self.error is not None:
            _fail(fut, self.dead_error())
            return fut
        self._calls.add(fut)
        fut.add_done_callback(self._calls.discard)

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

    def open_stream(self, request_id: str, direct: DirectStream | None = None) -> asyncio.Queue[StreamItem]:
        q: asyncio.Queue[StreamItem] = asyncio.Queue()
        if self.error is not None:
            q.put_nowait(_DEAD)  # type: ignore[arg-type]
        self._streams[request_id] = q
        if direct is not None:
            self._direct[request_id] = direct
        else:
            self._direct.pop(request_id, None)
        return q

    async def next(self, q: asyncio.Queue[StreamItem]) -> StreamItem:
        """The stream's next item; EngineDead once the engine has stopped."""
        item = await q.get()
        if item is _DEAD:
            q.put_nowait(item)  # every later read fails the same way
            raise self.dead_error()
        return item

    def take_ready(self, q: asyncio.Queue[StreamItem]) -> StreamItem | None:
        """The stream's next item if one is waiting already (the engine's stop is left for `next`)."""
        if q.empty():
            return None
        item = q.get_nowait()
        if item is _DEAD:
            q.put_nowait(item)
            return None
        return item

    def dead_error(self) -> EngineDead:
        return EngineDead(f"engine stopped: {self.error!r}")

    def _fail_all(self) -> None:
        """Event loop, once the engine thread has stopped: whatever waits on it fails now."""
        err = self.dead_error()
        for fut in list(self._calls):
            _fail(fut, err)
        for q in self._streams.values():
            q.put_nowait(_DEAD)  # type: ignore[arg-type]
        if self.on_death is not None:
            self.on_death()

    def close_stream(self, request_id: str, q: asyncio.Queue[StreamItem]) -> None:
        """Stop delivering to q; a newer stream opened under the same id (a retry) stays."""
        if self._streams.get(request_id) is q:
            del self._streams[request_id]
            self._direct.pop(request_id, None)

    def _route(self, outputs: list[RequestOutput]) -> list[StreamItem]:
        """Engine thread: send direct streams' outputs to the router; the last, any with top
        logprobs and any the socket refuses go to the event loop, with their stream index."""
        to_loop: list[StreamItem] = []
        batches: dict[str, tuple[list[bytes], list[StreamItem]]] = {}
        for out in outputs:
            d = self._direct.get(out.request_id)
            if d is None:
                to_loop.append((out, None))
                continue
            # Every output leaves from here, the first one too (the prompt's first token when it
            # was prefilled here, at index FIRST; imported KV's first decoded token, whose
            # transfer figures went ahead on the call): through the event loop, which the next
            # step's threads then compete with, a token reached the client 1.9 ms after its
            # step (median; up to 5), against 0.3 ms from here.
            first_here = not d.started and not d.count_first
            d.started = True
            index = FIRST if first_here else d.next_index
            if not first_here:
                d.next_index += len(out.new_token_ids)
            # The last output ends the gRPC stream; top and prompt logprobs have no place in a
            # token message.
            if out.finished or any(out.new_top_logprobs) or out.prompt_logprobs is not None:
                to_loop.append((out, index))
                continue
            chunk = TokenChunk(index, out.new_token_ids, out.text_delta, out.new_logprobs)
            if first_here:
                chunk.prefill_s, chunk.cached_tokens = out.prefill_s, out.num_cached_tokens
            frames, outs = batches.setdefault(d.endpoint, ([], []))
            frames += pack(d.request_id, d.attempt, d.key, chunk)
            outs.append((out, index))
        # One message per router and step, whatever the number of streams.
        for endpoint, (frames, outs) in batches.items():
            if not self._pusher.send(endpoint, frames):
                to_loop += outs
        return to_loop

    def _dispatch(self, items: list[StreamItem]) -> None:
        for item in items:
            q = self._streams.get(item[0].request_id)
            if q is not None:
                q.put_nowait(item)

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
            except Exception as e:
                # The engine's state is unknown from here: nothing more runs on it. Streams and
                # calls fail UNAVAILABLE, so the router retries them on other workers.
                log.exception("engine step failed: this worker stops serving")
                self.error = e
                self.loop.call_soon_threadsafe(self._fail_all)
                break
            self.steps += 1
            self.stats = eng.stats()
            items = self._route(outputs) if self._direct else [(out, None) for out in outputs]
            if items:
                self.loop.call_soon_threadsafe(self._dispatch, items)
        self._pusher.close()

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


def _fail(fut: asyncio.Future, err: BaseException) -> None:
    """Fail a call's future, marked as seen: callers that fire and forget (an abort on the way
    out) would otherwise each log "exception never retrieved" once the engine has stopped."""
    if not fut.done():
        fut.set_exception(err)
        fut.exception()
