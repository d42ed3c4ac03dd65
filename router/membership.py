"""Who is in the cluster: registration, heartbeats, draining, and dropping silent workers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdcommon.security import ClusterIdentity
from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    role: str
    address: str
    transfer_address: str
    num_blocks: int
    block_size: int
    channel: grpc.aio.Channel
    stub: Any
    state: str = "active"  # active | draining
    last_seen: float = field(default_factory=time.monotonic)
    status: pb.WorkerStatus | None = None
    # request id -> callback that fails the request (used when this worker dies)
    inflight: dict[str, Callable[[grpc.StatusCode, str], None]] = field(default_factory=dict)
    served: int = 0
    pending_blocks: int = 0  # reserved through this router since the last heartbeat
    incarnation: str = ""
    transfer_public_key: str = ""  # the KV receiver's CURVE key (encrypted transport), else ""
    # request id -> prompt tokens this prefill worker still has to compute for it (until its first token)
    queued: dict[str, int] = field(default_factory=dict)
    busy: float = 0.0  # the share of the time between its last two heartbeats its engine was stepping

    @property
    def free_blocks_estimate(self) -> int:
        return self._reported_free - self.pending_blocks

    @property
    def _reported_free(self) -> int:
        """Free blocks as of the last heartbeat (all of them before the first)."""
        return self.status.free_blocks if self.status is not None else self.num_blocks

    def observe_free(self, free_blocks: int) -> None:
        """A refused reservation told us the worker's real free count: trust it until the next heartbeat."""
        self.pending_blocks = max(self.pending_blocks, self._reported_free - free_blocks)

    @property
    def load(self) -> int:
        return len(self.inflight)

    @property
    def queued_tokens(self) -> int:
        return sum(self.queued.values())


MAX_RETIRED = 4096  # retired processes remembered; a scale-down's pod is gone long before this many


class Membership:
    def __init__(self, dead_after_s: float, channel_options: list | None = None,
                 identity: ClusterIdentity | None = None) -> None:
        self.identity = identity or ClusterIdentity("none")
        self.dead_after_s = dead_after_s
        self.channel_options = channel_options or []
        self.workers: dict[str, WorkerRecord] = {}
        # Workers this router drained for a scale-down: id -> incarnation. Until its launcher ends
        # it (a pod's SIGTERM can come seconds later), such a process must not join again as new:
        # its heartbeats are told to drain and its registrations are refused.
        self.retired: dict[str, str] = {}
        self.changed = asyncio.Event()  # set on any capacity change; waiters clear and re-check
        self.on_leave: list[Callable[[WorkerRecord, str], None]] = []

    def notify(self) -> None:
        self.changed.set()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until capacity changes (a worker joins, leaves or reports) or timeout_s passes."""
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def register(self, info: wpb.WorkerInfo) -> WorkerRecord:
        old = self.workers.get(info.worker_id)
        if old is not None and old.incarnation == info.incarnation and old.address == info.address:
            old.last_seen = time.monotonic()  # the same process again (a lost reply): nothing changes
            return old
        if old is not None:  # a new process under the same id: the old one is gone
            self.drop(info.worker_id, "replaced by a new process with the same id")
        channel = self.identity.aio_channel(info.address, self.channel_options)
        # A colocated worker is a decode worker that also prefills: same service.
        stub = (wrpc.PrefillWorkerStub if info.role == "prefill" else wrpc.DecodeWorkerStub)(channel)
        rec = WorkerRecord(info.worker_id, info.role, info.address, info.transfer_address, info.num_blocks,
                           info.block_size, channel, stub, incarnation=info.incarnation,
                           transfer_public_key=info.transfer_public_key)
        self.workers[info.worker_id] = rec
        log.info("worker joined", extra={"worker_id": info.worker_id, "role": info.role, "address": info.address})
        self.notify()
        return rec

    def heartbeat(self, worker_id: str, status: pb.WorkerStatus, incarnation: str = "") -> WorkerRecord | None:
        """None: unknown (dropped, or another process's heartbeat): the worker registers again."""
        rec = self.workers.get(worker_id)
        if rec is None or (incarnation and incarnation != rec.incarnation):
            return None
        now = time.monotonic()
        if rec.status is not None and now > rec.last_seen:
            rec.busy = min(max((status.engine_busy_s - rec.status.engine_busy_s) / (now - rec.last_seen), 0.0), 1.0)
        rec.last_seen = now
        rec.status = status
        rec.pending_blocks = 0
        if status.state == "draining" and rec.state == "active":  # it is going away (SIGTERM): no new work
            rec.state = "draining"
            log.info("worker draining", extra={"worker_id": worker_id})
        self.notify()
        return rec

    def leave(self, worker_id: str, incarnation: str, unfinished: int) -> bool:
        """A worker that drained itself says goodbye; False: not this router's (or not this process)."""
        rec = self.workers.get(worker_id)
        if rec is None or (incarnation and incarnation != rec.incarnation):
            return False
        if unfinished:
            log.warning("worker left before its requests finished",
                        extra={"worker_id": worker_id, "unfinished": unfinished})
        self.drop(worker_id, "drained", planned=not unfinished)
        return True

    def _fail_inflight(self, rec: WorkerRecord, why: str) -> None:
        for fail in list(rec.inflight.values()):
            fail(grpc.StatusCode.UNAVAILABLE, f"{rec.role} worker {rec.worker_id} {why}")
        rec.inflight.clear()

    def retire(self, worker_id: str) -> None:
        """Drop a worker the router drained on purpose, and remember its process (see `retired`)."""
        rec = self.workers.get(worker_id)
        if rec is not None:
            self.retired[worker_id] = rec.incarnation
            while len(self.retired) > MAX_RETIRED:  # oldest first: dicts keep insertion order
                del self.retired[next(iter(self.retired))]
        self.drop(worker_id, "drained", planned=True)

    def is_retired(self, worker_id: str, incarnation: str) -> bool:
        return self.retired.get(worker_id) == incarnation

    def drop(self, worker_id: str, why: str, planned: bool = False) -> None:
        """`planned`: a drained worker leaving (scale-down, shutdown), logged as info, not a warning."""
        rec = self.workers.pop(worker_id, None)
        if rec is None:
            return
        log.log(logging.INFO if planned else logging.WARNING, "dropping worker",
                extra={"worker_id": worker_id, "reason": why})
        self._fail_inflight(rec, why)
        asyncio.ensure_future(rec.channel.close())
        for cb in self.on_leave:
            cb(rec, why)
        self.notify()

    def active(self, role: str) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.role == role and w.state == "active"]

    def members(self, role: str) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.role == role]

    async def reap_forever(self, period_s: float) -> None:
        """Drop workers silent for dead_after_s. Time this loop itself could not run (the router's
        event loop was blocked) is not held against them: their heartbeats were waiting on us."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            stall = now - last - period_s
            last = now
            if stall > period_s:
                log.warning("router event loop stalled", extra={"stall_s": round(stall, 2)})
                for rec in self.workers.values():
                    rec.last_seen += stall
            for rec in list(self.workers.values()):
                if now - rec.last_seen > self.dead_after_s:
                    self.drop(rec.worker_id, f"stopped answering (no heartbeat for {now - rec.last_seen:.1f}s)")
