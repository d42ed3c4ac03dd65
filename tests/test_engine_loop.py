"""The worker's engine thread builds the engine it steps: torch ops of one engine stay on one
thread, so the process keeps a single OpenMP team (pdcommon/engine_loop.py says what a second
one cost), and a build that fails reaches whoever awaits the engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.engine_loop import EngineLoop


def test_the_engine_is_built_on_the_thread_that_steps_it(stories_path):
    async def main() -> tuple[int, int, int, list[int]]:
        built: dict[str, int] = {}

        def build() -> LLMEngine:
            built["thread"] = threading.get_ident()
            return LLMEngine(EngineConfig(model=stories_path, num_kv_blocks=64))

        el = EngineLoop(build, asyncio.get_running_loop())
        try:
            eng = await el.ready
            stepped: list[int] = []
            step = eng.step

            def traced_step():  # the engine's own step, noting the thread it runs on
                stepped.append(threading.get_ident())
                return step()

            eng.step = traced_step
            q = el.open_stream("r1")
            await el.call(eng.add_request, "r1", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
            while not (await el.next(q))[0].finished:
                pass
            return built["thread"], await el.call(threading.get_ident), threading.get_ident(), stepped
        finally:
            el.stop()

    build_thread, call_thread, loop_thread, stepped = asyncio.run(main())
    assert build_thread == call_thread != loop_thread
    assert stepped and set(stepped) == {build_thread}


def test_a_build_that_fails_fails_ready():
    async def main() -> None:
        def build() -> LLMEngine:
            raise ValueError("no such model")

        el = EngineLoop(build, asyncio.get_running_loop())
        try:
            await el.ready
        finally:
            el.stop()

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(main())
