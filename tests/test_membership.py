"""The router's membership table: a planned departure is not reported as a fault; what heartbeats
tell about a worker."""

import asyncio
import logging
import time

from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import worker_pb2 as wpb
from router.membership import Membership


def _info(worker_id: str) -> wpb.WorkerInfo:
    return wpb.WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:1", incarnation=f"{worker_id}-1")


def test_drained_workers_leave_at_info_and_failed_ones_at_warning(caplog):
    async def run() -> None:
        members = Membership(dead_after_s=5.0)
        for wid in ("decode-0", "decode-1", "decode-2"):
            members.register(_info(wid))
        members.retire("decode-0")  # scale-down: the router drained it
        members.leave("decode-1", "decode-1-1", unfinished=0)  # shutdown: it drained itself
        members.drop("decode-2", "stalled: no token for 9.0s")
        await asyncio.sleep(0)  # the dropped channels close

    with caplog.at_level(logging.INFO, logger="router.membership"):
        asyncio.run(run())
    levels = {r.worker_id: r.levelno for r in caplog.records if r.getMessage() == "dropping worker"}
    assert levels == {"decode-0": logging.INFO, "decode-1": logging.INFO, "decode-2": logging.WARNING}


def test_a_workers_busy_share_is_its_engine_time_between_heartbeats():
    async def run() -> float:
        members = Membership(dead_after_s=5.0)
        members.register(_info("decode-0"))
        members.heartbeat("decode-0", pb.WorkerStatus(engine_busy_s=10.0), "decode-0-1")
        t0 = time.monotonic()
        await asyncio.sleep(0.4)
        busy_s = 0.5 * (time.monotonic() - t0)  # an engine stepping half the time since then
        rec = members.heartbeat("decode-0", pb.WorkerStatus(engine_busy_s=10.0 + busy_s), "decode-0-1")
        return rec.busy

    assert 0.45 <= asyncio.run(run()) <= 0.5
