"""Serving threads give way to the engine's compute threads (pdcommon/priority.py): in real
`pdserve router|prefill|decode` processes, the event-loop thread runs at a higher nice value
once the component has started, and the thread that ran the engine's steps keeps the original."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdcommon.client import make_request
from pdcommon.config import ProcessSection
from pdcommon.priority import lower_thread_priority
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
        for name, pid in pids.items():
            after = _threads(pid)
            # The main thread runs the event loop (asyncio.run) of a standalone component.
            assert after[pid][0] == base + io_nice, f"{name}: event loop at nice {after[pid][0]}, not {base + io_nice}"
            if name == "router":
                continue
            # The engine thread did nearly all of the work of these requests: it kept its priority.
            busiest = max(after, key=lambda t: after[t][1] - before[name].get(t, (0, 0))[1])
            assert busiest != pid and after[busiest][0] == base, (
                f"{name}: the busiest thread {busiest} runs at nice {after[busiest][0]}, not {base}")
    finally:
        c.stop()


def test_zero_changes_nothing():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert lower_thread_priority(0) is None
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
