"""Admission: a request holds a reservation on a decode worker (or a colocated one) for its
whole life. The router asks workers with room in policy order, and otherwise waits in a
bounded queue until capacity changes or the deadline passes."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import grpc

from pdcommon.token_stream import TokenInbox
from pdcommon.v1 import worker_pb2 as wpb
from router.membership import Membership, WorkerRecord
from router.policy import RoutingPolicy
from router.request import RequestFailed, RequestState, client_cancelled


@dataclass(slots=True)
class Lease:
    """An open Decode call with its reservation; released on every path by its attempt."""

    worker: WorkerRecord
    call: object
    reservation: wpb.Reservation
    # One-time key of this reservation: the decode worker lands only KV signed with it, and the
    # router gives it to no one but the prefill worker it picks for this attempt.
    transfer_key: bytes = b""
    # Tokens the decode worker's engine thread sends to the router's ZeroMQ port (None: all of
    # them on the call), and the inbox they arrive in.
    tokens: asyncio.Queue | None = None
    inbox: TokenInbox | None = None

    def release(self, st: RequestState) -> None:
        self.worker.inflight.pop(st.request_id, None)
        self.call.cancel()
        if self.inbox is not None:
            self.inbox.close_stream(st.worker_request_id, st.attempt)


class Admission:
    def __init__(self, members: Membership, policy: RoutingPolicy, role: str, block_size: int, queue_size: int,
                 transfer_timeout_s: float) -> None:
        self.members, self.policy, self.role = members, policy, role
        self.block_size, self.queue_size, self.transfer_timeout_s = block_size, queue_size, transfer_timeout_s
        self.waiting = 0
        self.tokens: TokenInbox | None = None  # set when the router's token port is open

    def _ranked(self, st: RequestState, need: int) -> list[WorkerRecord]:
        ranked = self.policy.rank_decode(self.members.active(self.role), st.prefix, need)
        # After a failed attempt, other workers first; the same one only as a last resort.
        return [w for w in ranked if w.worker_id not in st.avoid] + [w for w in ranked if w.worker_id in st.avoid]

    async def admit(self, st: RequestState, local: bool) -> Lease:
        """A lease on a worker with room; `local`: that worker computes the prompt itself."""
        need = -(-st.blocks_needed_tokens // self.block_size)
        queued = False
        try:
            while True:
                for w in self._ranked(st, need):
                    lease = await self._try(w, st, need, local)
                    if lease is not None:
                        return lease
                if not queued:
                    if self.waiting >= self.queue_size:
                        raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"router queue full ({self.waiting} waiting); retry later")
                    queued = True
                    self.waiting += 1
                if st.remaining <= 0:
                    raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"no {self.role} worker had room for {need} KV blocks before the deadline")
                await self.members.wait_changed(min(st.remaining, 1.0))
        finally:
            if queued:
                self.waiting -= 1

    async def _try(self, w: WorkerRecord, st: RequestState, need: int, local: bool) -> Lease | None:
        """Open a Decode call on `w`; a lease if it reserved room, None if it had none."""
        key = b"" if local else secrets.token_bytes(32)
        req = wpb.DecodeRequest(
            request_id=st.worker_request_id, prompt_token_ids=st.prompt, sampling=st.sampling(),
            transfer_timeout_s=self.transfer_timeout_s, attempt=st.attempt, prefill_here=local,
            resume_token_ids=st.sent_ids, transfer_key=key)
        inbox, tokens, lease = self.tokens, None, None
        if inbox is not None:  # open before the call: the worker's tokens can only follow it
            req.token_port, req.token_key = inbox.port, secrets.token_bytes(16)
            tokens = inbox.open(st.worker_request_id, st.attempt, req.token_key)
        try:
            call, reservation = await self._reserve(w, st, req)
            if reservation is not None:
                w.pending_blocks += need - reservation.num_held_blocks
                lease = Lease(w, call, reservation, key, tokens, inbox)
            return lease
        finally:
            if lease is None and inbox is not None:
                inbox.close_stream(st.worker_request_id, st.attempt)

    async def _reserve(self, w: WorkerRecord, st: RequestState, req: wpb.DecodeRequest):
        """The call and its reservation, or (call, None) when the worker had no room."""
        call = w.stub.Decode(req, timeout=max(st.remaining, 0.001), metadata=self.members.identity.metadata)
        # Count the request against the worker now, so concurrent admissions spread out.
        w.inflight[st.request_id] = st.fail
        try:
            first = await call.read()
        except asyncio.CancelledError:
            w.inflight.pop(st.request_id, None)
            call.cancel()
            if client_cancelled():  # the client left while we waited: nothing may stay counted
                raise
            st.failure = None  # the worker was dropped (its channel closed) mid-reservation: try another
            return call, None
        except grpc.aio.AioRpcError as e:
            w.inflight.pop(st.request_id, None)
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise RequestFailed(e.code(), e.details()) from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.members.drop(w.worker_id, f"unreachable ({e.details()})")
            return call, None
        if first is grpc.aio.EOF or not first.reservation.ok:
            w.inflight.pop(st.request_id, None)
            if first is not grpc.aio.EOF:
                w.observe_free(first.reservation.free_blocks)
            call.cancel()
            return call, None
        return call, first.reservation
