"""The router's membership table: a planned departure is not reported as a fault."""

import asyncio
import logging

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
