"""Components serve on the loop `process.event_loop` names (uvloop by default): through
`event_loop.run` (what the CLI's runner calls), a Ray actor's LoopHost and the in-process
cluster."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
import uvloop

from pdcommon import event_loop
from pdcommon.config import load_config
from pdserve.launch.inprocess import InProcessCluster
from pdserve.launch.loop_host import LoopHost


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_uvloop_is_the_default():
    assert load_config(None).process.event_loop == "uvloop"


@pytest.mark.parametrize("kind, uv", [("uvloop", True), ("asyncio", False)])
def test_run_serves_on_the_chosen_loop(kind, uv):
    assert issubclass(event_loop.run(_loop_type(), kind), uvloop.Loop) is uv


def test_without_uvloop_the_standard_loop_serves(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now raises ImportError
    with caplog.at_level(logging.WARNING, logger="pdcommon.event_loop"):
        got = event_loop.run(_loop_type(), "uvloop")
    assert not issubclass(got, uvloop.Loop)
    assert "not installed" in caplog.text


@pytest.mark.parametrize("kind, uv", [("uvloop", True), ("asyncio", False)])
def test_a_loop_host_serves_on_the_configured_loop(kind, uv):
    async def serve(stop: asyncio.Event, started: asyncio.Future) -> None:
        started.set_result(type(asyncio.get_running_loop()).__name__)
        await stop.wait()

    host = LoopHost(serve, event_loop=kind)
    try:
        assert (host.wait(10) == "Loop") is uv  # uvloop.Loop, or asyncio's _UnixSelectorEventLoop
    finally:
        host.stop()


@pytest.mark.parametrize("kind, uv", [("uvloop", True), ("asyncio", False)])
def test_the_in_process_cluster_runs_on_the_configured_loop(kind, uv, stories_path):
    cluster = InProcessCluster(load_config(None, model=stories_path, **{"process.event_loop": kind}))
    try:
        assert isinstance(cluster.loop, uvloop.Loop) is uv
    finally:
        cluster.loop.close()
