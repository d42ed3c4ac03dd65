"""Serving threads give way to the engine's compute threads (pdcommon/priority.py): in real
`pdserve router|prefill|decode` processes, the event-loop thread runs at a higher nice value
once the component has started, and the thread that ran the engine's steps keeps the original.
Serving threads ask for a short scheduler slice, so that a woken one need not wait for the
engine's; the engine thread (and the OpenMP team it starts) keeps the kernel's default."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pdcommon.client import make_request
from pdcommon.config import ProcessSection
from pdcommon.engine_loop import ENGINE_THREAD_NAME
from pdcommon.priority import lower_thread_priority, set_thread_slice, thread_slice_us
from tests.cluster_utils import ProcessCluster


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (nice, CPU ticks) for every thread of a process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (int(fields[16]), int(fields[11]) + int(fields[12]))
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_serving_threads_yield_to_the_engine(stories_path, tmp_path):
    base, io_nice = os.getpriority(os.PRIO_PROCESS, 0), ProcessSection().io_nice
    if base > 19 - io_nice:
        pytest.skip(f"this test already runs at a nice value too high to raise by {io_nice}")
    c = ProcessCluster(stories_path, tmp_path, prefill=1, decode=1)
    try:
        pids = {name: p.pid for name, p in c.procs.items()}
        before = {name: _threads(pid) for name, pid in pids.items()}
        with c.client() as cl:
            for i in range(4):  # long prompts for the prefill worker's engine, long outputs for the decode one's
                prompt = f"Story {i}. " + "Once upon a time there was a cat. " * 30
                list(cl.stream(make_request(prompt, max_tokens=150, ignore_eos=True), timeout=60))
        slices = _slices_supported()
        for name, pid in pids.items():
            after = _threads(pid)
            # The main thread runs the event loop (asyncio.run) of a standalone component.
            assert after[pid][0] == base + io_nice, f"{name}: event loop at nice {after[pid][0]}, not {base + io_nice}"
            if slices:
                assert thread_slice_us(pid) == ProcessSection().serving_slice_us, f"{name}: event loop's slice"
                io = [t for t in after if _comm(pid, t).startswith("ZMQbg/IO")]
                assert io and all(thread_slice_us(t) == ProcessSection().serving_slice_us for t in io), (
                    f"{name}: ZeroMQ I/O threads' slices {[thread_slice_us(t) for t in io]}")
            if name == "router":
                continue
            # The engine thread (and its OpenMP team, which inherits its name) kept its priority and
            # the default slice. Found by name: with this tiny model a prefill worker's event loop may
            # use more CPU than its engine, so the busiest thread need not be the engine's.
            engine = [t for t in after if _comm(pid, t) == ENGINE_THREAD_NAME]
            assert engine and pid not in engine, f"{name}: no thread named {ENGINE_THREAD_NAME}"
            assert all(after[t][0] == base for t in engine), (
                f"{name}: engine threads at nice {[after[t][0] for t in engine]}, not {base}")
            if slices:
                assert all(thread_slice_us(t) == slices for t in engine), f"{name}: an engine thread's slice"
            # And the engine did this work: in the decode worker, 600 tokens' steps.
            if name.startswith("decode"):
                busiest = max(after, key=lambda t: after[t][1] - before[name].get(t, (0, 0))[1])
                assert busiest in engine, f"{name}: the busiest thread is {_comm(pid, busiest)!r}"
    finally:
        c.stop()


def test_zero_changes_nothing():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert lower_thread_priority(0) is None
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _slices_supported() -> float | None:
    """The kernel's default slice (us) where threads can ask for their own (Linux 6.12 on), else None."""
    default = _in_thread(thread_slice_us)
    if default is None or default == 250:
        return None
    took = _in_thread(lambda: set_thread_slice(250) and thread_slice_us())
    return default if took == 250 else None


def test_a_slice_is_inherited_and_zero_restores_the_default():
    default = _slices_supported()
    if default is None:
        pytest.skip("this kernel keeps no per-thread slice")

    def serving() -> tuple:
        assert set_thread_slice(150)
        child = _in_thread(thread_slice_us)  # started after: inherits it
        restored = _in_thread(lambda: (set_thread_slice(0), thread_slice_us())[1])
        return thread_slice_us(), child, restored, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine, child, restored, nice = _in_thread(serving)
    assert (mine, child, restored) == (150, 150, default)
    assert nice == os.getpriority(os.PRIO_PROCESS, 0)  # the nice value is kept


def test_the_engine_thread_keeps_the_default_slice(stories_path):
    """Built by a serving thread with a short slice, the engine thread (and so the OpenMP team it
    starts) returns to the default; the token pusher's ZeroMQ I/O thread, started on the serving
    thread, keeps the short one."""
    import asyncio

    from engine import EngineConfig, LLMEngine
    from pdcommon.engine_loop import EngineLoop

    default = _slices_supported()
    if default is None:
        pytest.skip("this kernel keeps no per-thread slice")

    def serving() -> tuple:
        set_thread_slice(120)
        before = {t.name for t in Path("/proc/self/task").iterdir()}

        async def main():
            el = EngineLoop(lambda: LLMEngine(EngineConfig(model=stories_path, num_kv_blocks=64)),
                            asyncio.get_running_loop())
            try:
                await el.ready
                io = [thread_slice_us(int(t.name)) for t in Path("/proc/self/task").iterdir()
                      if t.name not in before and _comm(os.getpid(), int(t.name)).startswith("ZMQbg/IO")]
                return await el.call(thread_slice_us), io
            finally:
                el.stop()

        return asyncio.run(main())

    engine, io = _in_thread(serving)
    assert engine == default
    assert io == [120]
