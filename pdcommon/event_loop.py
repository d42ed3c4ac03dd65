"""The event loop every pdserve component serves on (`process.event_loop`).

uvloop by default: the router's and workers' loops carry every request's intake, its first
token and the HTTP stream. `bench/overhead.py --compare-event-loops 6` on stories260K (1 prefill
+ 1 decode as processes, the two loops alternating, twice; 12 pairs): a 1-token request's p50
2.56-2.68 ms against 2.84-2.86 (lower in 9 of 12 pairs), 8-token requests at concurrency 16
262-266 req/s against 225-238 (higher in 8 of 12), at 64 375-381 against 345-348 (9 of 12); a
stream's inter-token time the same (0.84 ms). grpc.aio and aiohttp run on it unchanged. Where
uvloop is not installed (a platform without a wheel), asyncio's loop serves, with a warning.

orjson was measured too and not taken: an SSE token event costs json.dumps 3.3 us (orjson 0.3),
about 1% of a core at the 3,000 events a second of the concurrency-64 run above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

log = logging.getLogger(__name__)
EventLoopKind = Literal["uvloop", "asyncio"]
T = TypeVar("T")


def loop_factory(kind: EventLoopKind) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new loop of this kind."""
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("process.event_loop is uvloop, which is not installed: serving on asyncio's loop")
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def new_event_loop(kind: EventLoopKind) -> asyncio.AbstractEventLoop:
    return loop_factory(kind)()


def run(main: Coroutine[Any, Any, T], kind: EventLoopKind) -> T:
    """asyncio.run(main) on a loop of this kind."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)
