"""gRPC servicers of the router: the public Router API and the internal Control API (two ports)."""

from __future__ import annotations

import logging
import time

import grpc

from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import router_pb2_grpc as rrpc
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc
from router.core import RouterCore
from router.request import RequestFailed
from router.scaling import Scaler

log = logging.getLogger(__name__)


class RouterService(rrpc.RouterServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            st = await self.core.parse(request, context.time_remaining())
            async for msg in self.core.generate(st):
                yield msg
        except RequestFailed as e:
            await context.abort(e.code, e.message)

    async def Health(self, request, context) -> pb.HealthResponse:
        m = self.core.members
        p, d = len(m.active("prefill")), len(m.active("decode")) + len(m.active("colocated"))
        return pb.HealthResponse(ready=self.core.ready(), prefill_workers=p, decode_workers=d)

    async def ClusterStatus(self, request, context) -> pb.ClusterStatusResponse:
        core = self.core
        now = time.monotonic()
        resp = pb.ClusterStatusResponse(queued_requests=core.waiting, model=core.model.name,
                                        transport=core.cfg.transfer.transport, mode=core.cfg.mode,
                                        http_address=core.http_address, vocab_size=core.model.vocab_size,
                                        max_model_len=core.model.max_model_len,
                                        control_address=core.control_address,
                                        security_mode=core.cfg.security.mode, planner=core.planner_status)
        for role in core.cfg.roles:
            resp.pools.append(pb.PoolStatus(role=role, replicas=len(core.members.active(role)),
                                            target_replicas=core.targets[role]))
        for w in sorted(core.members.workers.values(), key=lambda w: (w.role, w.worker_id)):
            st = pb.WorkerStatus()
            if w.status is not None:
                st.CopyFrom(w.status)
            st.worker_id, st.role, st.address, st.state = w.worker_id, w.role, w.address, w.state
            st.inflight, st.requests_served = w.load, w.served
            st.last_heartbeat_age_s = now - w.last_seen
            st.engine_busy_fraction = w.busy
            resp.workers.append(st)
        return resp


class ControlService(wrpc.ControlServicer):
    """The internal control plane: only cluster members reach it (see pdcommon/security.py)."""

    def __init__(self, core: RouterCore, scaler: Scaler) -> None:
        self.core = core
        self.scaler = scaler

    async def Register(self, request: wpb.WorkerInfo, context) -> wpb.RegisterReply:
        why = self.core.check_worker(request)
        if why is not None:
            log.warning("refused worker", extra={"worker_id": request.worker_id, "reason": why})
            return wpb.RegisterReply(accepted=False, message=why)
        self.core.members.register(request)
        return wpb.RegisterReply(accepted=True)

    async def Heartbeat(self, request: wpb.HeartbeatRequest, context) -> wpb.HeartbeatReply:
        rec = self.core.members.heartbeat(request.worker_id, request.status, request.incarnation)
        if rec is None:  # a retired process is told to drain, so it does not register again
            return wpb.HeartbeatReply(known=False, drain=self.core.members.is_retired(request.worker_id,
                                                                                     request.incarnation))
        return wpb.HeartbeatReply(known=True, drain=rec.state == "draining")

    async def Leave(self, request: wpb.LeaveRequest, context) -> wpb.LeaveReply:
        return wpb.LeaveReply(known=self.core.members.leave(request.worker_id, request.incarnation,
                                                             request.unfinished))

    async def Scale(self, request: pb.ScaleRequest, context) -> pb.ScaleResponse:
        try:
            prev, adding, draining = await self.scaler.scale(request.pool, request.replicas)
        except RequestFailed as e:
            await context.abort(e.code, e.message)
        return pb.ScaleResponse(previous=prev, target=request.replicas, adding=adding, draining=draining)
