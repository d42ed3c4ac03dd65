"""The request path: admit (a reservation on a decode worker) -> prefill (first token to the
client at once; the prefill worker ships the KV) -> relay (the decode stream to the client).

The decode stream is the one report of the KV transfer: it fails with DATA_LOSS or ABORTED when
the KV is rejected or never arrives. Such a failure, a worker lost (broken stream, dropped by
membership) or a decode stream silent for `router.stall_timeout_s` raises RetryAttempt, and
`_attempts` runs the path again on other workers: it resumes after the tokens the client already
has (the engines count them as outputs, so seeded sampling draws the same tokens), so the client
sees one unbroken stream. Retries stop after `router.max_retries` or `router.retry_window_s`;
an overload refusal (RESOURCE_EXHAUSTED) is never retried. Reading the workers' calls, and what
their failures mean, is router/worker_stream.py."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc

from engine import KVLayout, ModelInfo
from pdcommon.config import ClusterConfig
from pdcommon.convert import layout_from_proto
from pdcommon.grpc_server import message_options
from pdcommon.security import ClusterIdentity
from pdcommon.token_stream import FIRST
from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import worker_pb2 as wpb
from router.admission import Admission, Lease
from router.intake import Intake
from router.launcher import Launcher
from router.membership import Membership, WorkerRecord
from router.policy import make_policy
from router.request import RequestFailed, RequestState, RetryAttempt
from router.worker_stream import WorkerStreams, first_token, kv_figures, no_first

log = logging.getLogger(__name__)


class RouterCore:
    def __init__(self, cfg: ClusterConfig, launcher: Launcher | None = None, model: ModelInfo | None = None,
                 identity: ClusterIdentity | None = None) -> None:
        self.cfg = cfg
        self.model = model or ModelInfo.load(cfg.model, cfg.engine.max_model_len)
        # How the router reaches workers: the cluster's credentials on every call.
        self.identity = identity or ClusterIdentity.from_config(cfg.security)
        self.members = Membership(cfg.heartbeat.dead_after_s, message_options(cfg.router.max_request_bytes),
                                  self.identity)
        self.streams = WorkerStreams(self.members, cfg.router.stall_timeout_s)
        self.policy = make_policy(cfg.router.routing)
        self.launcher = launcher
        self.block_size = cfg.engine.block_size
        self.colocated = cfg.mode == "colocated"
        self.admission = Admission(self.members, self.policy, "colocated" if self.colocated else "decode",
                                   self.block_size, cfg.router.queue_size, cfg.transfer.timeout_s)
        # What each pool's KV blocks must look like: checked when a worker registers.
        self.layouts = {role: KVLayout.of(self.model.spec, cfg.engine_config(role).dtype, self.block_size)
                        for role in cfg.roles}
        self.active: dict[str, RequestState] = {}
        self.targets = {role: cfg.pool(role).replicas for role in cfg.roles}
        # Objects with on_token(st, n, now) / on_finish(st, msg) / on_fail(st, err) / on_abort(st).
        self.observers: list = []
        self.planner_status = ""  # the planner's mode and last decision, JSON (router/autoscale.py)
        self.http_address = ""
        self.control_address = ""
        self.intake = Intake(self.model, cfg.router.request_timeout_s, self.block_size, cfg.router.max_request_bytes)

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    def ready(self) -> bool:
        return all(self.members.active(role) for role in self.cfg.roles)

    def check_worker(self, info: wpb.WorkerInfo) -> str | None:
        """Why a registering worker cannot join this cluster, or None."""
        if info.role not in self.cfg.roles:
            return f"role {info.role!r} does not serve this {self.cfg.mode} cluster"
        if info.model_fingerprint != self.model.fingerprint:
            return (f"worker serves model {info.model!r} (fingerprint {info.model_fingerprint[:12] or 'none'}), "
                    f"the router serves {self.model.name!r} ({self.model.fingerprint[:12]}): config.json or "
                    f"tokenizer differ")
        if self.members.is_retired(info.worker_id, info.incarnation):
            return f"worker {info.worker_id!r} was drained for a scale-down and is going away"
        held = self.members.workers.get(info.worker_id)
        if held is not None and held.address != info.address:
            # Never repoint a live worker's id: its owner is still heartbeating from `held.address`.
            return (f"worker id {info.worker_id!r} belongs to a live worker at {held.address}; a worker of "
                    f"that id may register again only from the same address, or after it is dropped")
        want, got = self.layouts[info.role], layout_from_proto(info.kv_layout)
        if got != want:
            return (f"KV layout {got.dtype}{list(got.block_shape)} differs from the {want.dtype}"
                    f"{list(want.block_shape)} this cluster's {info.role} pool uses "
                    f"(dtype, [layers, 2, block_size, kv_heads, head_dim])")
        return None

    # ---- input ---------------------------------------------------------------------------------
    async def offload(self, fn, *args):
        return await self.intake.offload(fn, *args)

    async def parse(self, request: pb.GenerateRequest, time_remaining: float | None) -> RequestState:
        """Validate and tokenize; a rejected request is counted like any other failure."""
        try:
            st = await self.intake.parse(request, time_remaining)
            if st.request_id in self.active:
                raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request id {st.request_id!r} is already in flight")
        except RequestFailed as e:
            for ob in self.observers:
                ob.on_fail(None, e)
            raise
        return st

    # ---- the request path ----------------------------------------------------------------------
    async def generate(self, st: RequestState):
        """Yields GenerateResponse messages; raises RequestFailed with a status for the client."""
        self.active[st.request_id] = st
        for ob in self.observers:
            ob.on_start(st)
        try:
            async for msg in self._attempts(st):
                yield msg
        except RequestFailed as e:
            log.info("request failed", extra={"request_id": st.request_id, "code": e.code.name, "reason": e.message,
                                              "prefill_worker": st.prefill_worker, "decode_worker": st.decode_worker})
            for ob in self.observers:
                ob.on_fail(st, e)
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away or cancelled
            log.info("request cancelled by the client", extra={"request_id": st.request_id})
            for ob in self.observers:
                ob.on_abort(st)
            raise
        finally:
            self.active.pop(st.request_id, None)
            self.members.notify()

    async def _attempts(self, st: RequestState):
        r = self.cfg.router
        while True:
            try:
                async for msg in self._attempt(st):
                    yield msg
                return
            except RetryAttempt as e:
                now = time.monotonic()
                st.first_failure = st.first_failure or now
                if st.attempt >= r.max_retries or now - st.first_failure > r.retry_window_s or st.remaining <= 0:
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, e.message) from e
                log.warning("retrying request", extra={"request_id": st.request_id, "reason": e.message,
                                                        "resume_after": len(st.sent_ids)})
                st.avoid.add(e.worker)
                st.attempt += 1
                st.failure = None

    async def _attempt(self, st: RequestState):
        """admit -> prefill -> relay, once. A 1-token request (disaggregated) skips admission: it
        ends with the prefill, so it needs no decode reservation (whose round trip came before the
        prefill and was a third of its time) and no KV ships. A short prompt (disaggregated,
        `router.local_prefill_max_tokens`) is prefilled by its decode worker, as colocated."""
        one_token = not self.colocated and st.params.max_tokens == 1
        local = self.colocated or (not one_token and self._prefill_locally(st))
        lease = None if one_token else await self.admission.admit(st, local)
        st.calls = [] if lease is None else [lease.call]
        if lease is not None:
            st.decode_worker = lease.worker.worker_id
        try:
            if local and lease.tokens is not None:
                async for msg in self._local_direct(st, lease):
                    yield msg
                return
            first = await (self._first_local(st, lease) if local else self._prefill(st, lease))
            yield first
            if first.finish_reason or lease is None:  # max_tokens 1: the first token always finishes
                return
            async for msg in self._relay(st, lease):
                yield msg
        finally:
            if lease is not None:
                lease.release(st)
                lease.worker.served += 1
            self._release_prefill(st)
            for call in st.calls:
                call.cancel()
            st.calls = []

    def _prefill_locally(self, st: RequestState) -> bool:
        """Disaggregated: whether this prompt (with any tokens it resumes after) is short enough
        for its decode worker to compute."""
        return len(st.prompt) + len(st.sent_ids) <= self.cfg.router.local_prefill_max_tokens

    def _release_prefill(self, st: RequestState) -> None:
        """The request no longer depends on its prefill worker (its KV landed, or the attempt ended)."""
        if st.prefill_rec is not None:
            st.prefill_rec.inflight.pop(st.request_id, None)
            st.prefill_rec.queued.pop(st.request_id, None)
            st.prefill_rec = None

    async def _pick_prefill(self, st: RequestState) -> WorkerRecord:
        """A prefill worker (one that failed this request before only as a last resort). With the
        pool empty (all lost at once), wait for one to register, as admission waits for room."""
        end = time.monotonic() + min(self.cfg.router.retry_window_s, max(st.remaining, 0.0))
        while True:
            active = self.members.active("prefill")
            fresh = [w for w in active if w.worker_id not in st.avoid]
            pw = self.policy.pick_prefill(fresh or active, st.prefix, len(st.prompt))
            if pw is not None:
                return pw
            if time.monotonic() >= end:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available")
            await self.members.wait_changed(min(end - time.monotonic(), 1.0))

    async def _prefill(self, st: RequestState, lease: Lease | None) -> pb.GenerateResponse:
        """The next token from a prefill worker, which then ships the KV to the lease's worker
        (without a lease, the request ends with this token and nothing ships)."""
        pw = await self._pick_prefill(st)
        st.prefill_worker = pw.worker_id
        if lease is not None:
            self.policy.record(st.prefix, pw.worker_id, lease.worker.worker_id)
        # Until its KV lands the request depends on this worker: dropping it fails (retries) the request.
        pw.inflight[st.request_id] = st.fail
        pw.queued[st.request_id] = len(st.prompt) - self.policy.expected_cached(pw, st.prefix, len(st.prompt))
        st.prefill_rec = pw
        pw.served += 1
        req = wpb.PrefillRequest(request_id=st.worker_request_id, prompt_token_ids=st.prompt,
                                 sampling=st.sampling(), transfer_timeout_s=self.cfg.transfer.timeout_s,
                                 attempt=st.attempt, resume_token_ids=st.sent_ids)
        if lease is not None:
            req.decode_transfer_address = lease.worker.transfer_address
            req.skip_blocks = lease.reservation.num_held_blocks
            req.transfer_key, req.decode_transfer_public_key = lease.transfer_key, lease.worker.transfer_public_key
        call = pw.stub.Prefill(req, timeout=max(st.remaining, 0.001), metadata=self.identity.metadata)
        st.calls.append(call)  # stays open while the KV ships; cancelled with the attempt
        msg = await self.streams.read(st, call, pw)
        pw.queued.pop(st.request_id, None)  # computed (or failed): no longer ahead of other prompts
        if msg is grpc.aio.EOF:
            raise RetryAttempt(f"prefill worker {pw.worker_id} closed the stream before the first token", "prefill",
                               pw.worker_id)
        return self._first_token(st, msg.first)

    async def _first_local(self, st: RequestState, lease: Lease) -> pb.GenerateResponse:
        """The worker holding the lease computes the next token itself (colocated, or a short
        prompt prefilled by its decode worker)."""
        self._record_local(st, lease)
        msg = await self.streams.read(st, lease.call, lease.worker)
        if msg is grpc.aio.EOF or not msg.HasField("first"):
            raise no_first(lease.worker)
        return self._first_token(st, msg.first)

    def _record_local(self, st: RequestState, lease: Lease) -> None:
        st.prefill_worker = lease.worker.worker_id
        self.policy.record(st.prefix, lease.worker.worker_id, lease.worker.worker_id)

    async def _local_direct(self, st: RequestState, lease: Lease):
        """As _first_local then _relay, with tokens direct: the first one comes on either channel
        (the worker's engine thread sends it direct unless it ends the stream), at index FIRST."""
        self._record_local(st, lease)
        async with aclosing(self.streams.direct_chunks(st, lease, start=FIRST)) as chunks:
            tok = await anext(chunks)
            first = self._first_token(st, first_token(tok))
            yield first
            if first.finish_reason:
                return
            async for msg in self._relayed(st, chunks):
                yield msg

    def _first_token(self, st: RequestState, ft: wpb.FirstToken) -> pb.GenerateResponse:
        """The token a prefill computed: the request's first, or the next one after a resume."""
        st.cached_tokens, st.prefill_s = ft.cached_tokens, ft.prefill_s
        fresh = st.first_sent is None  # not a resume after failover
        if fresh:
            now = time.monotonic()
            st.queue_s = max(now - st.arrival - ft.prefill_s, 0.0)
            st.first_sent = st.last_token = now
            st.completion_tokens = 1
        else:
            self._tokens(st, 1)
        st.sent_ids.append(ft.token_id)
        msg = pb.GenerateResponse(request_id=st.request_id, token_ids=[ft.token_id], text=ft.text,
                                  logprobs=[ft.logprob], prefill_worker=st.prefill_worker,
                                  decode_worker=st.decode_worker)
        if ft.HasField("top_logprobs"):
            msg.top_logprobs.append(ft.top_logprobs)
        if fresh and st.params.prompt_logprobs is not None:
            msg.prompt_logprobs.extend(ft.prompt_logprobs)
            msg.prompt_top_logprobs.extend(ft.prompt_top_logprobs)
            msg.prompt_token_ids.extend(st.prompt)
        return self._finish(msg, st, ft.finish_reason) if ft.finish_reason else msg

    async def _relay(self, st: RequestState, lease: Lease):
        streams = self.streams
        chunks = streams.direct_chunks(st, lease) if lease.tokens is not None else streams.call_chunks(st, lease)
        async with aclosing(chunks):
            async for msg in self._relayed(st, chunks):
                yield msg

    async def _relayed(self, st: RequestState, chunks):
        """The decoded tokens after the first, to the client."""
        first = True
        async for tok in chunks:
            if first:
                self._release_prefill(st)  # the KV landed: the prefill worker's fate no longer matters
                first = False
            kv_figures(st, tok)
            self._tokens(st, len(tok.token_ids))
            st.sent_ids.extend(tok.token_ids)
            out = pb.GenerateResponse(request_id=st.request_id, token_ids=tok.token_ids, text=tok.text,
                                      logprobs=tok.logprobs, top_logprobs=tok.top_logprobs)
            if tok.finish_reason:
                st.decode_batch = tok.decode_batch
                yield self._finish(out, st, tok.finish_reason)
                return
            yield out

    def _tokens(self, st: RequestState, n: int) -> None:
        now = time.monotonic()
        for ob in self.observers:
            ob.on_token(st, n, now)
        st.completion_tokens += n
        st.last_token = now

    def _finish(self, msg: pb.GenerateResponse, st: RequestState, reason: str) -> pb.GenerateResponse:
        now = time.monotonic()
        st.last_token = now
        msg.finish_reason = reason
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(st.prompt), cached_tokens=st.cached_tokens,
                                    completion_tokens=st.completion_tokens, kv_transfer_bytes=st.transfer_bytes))
        ttft = (st.first_sent or now) - st.arrival
        tpot = (now - st.first_sent) / (st.completion_tokens - 1) if st.first_sent and st.completion_tokens > 1 else 0.0
        msg.timings.CopyFrom(pb.Timings(queue=st.queue_s, prefill=st.prefill_s, kv_transfer=st.transfer_s,
                                        ttft=ttft, tpot=tpot, e2e=now - st.arrival))
        msg.prefill_worker, msg.decode_worker = st.prefill_worker, st.decode_worker
        msg.slo_met = slo_met(st.slo, ttft, tpot) is not False
        for ob in self.observers:
            ob.on_finish(st, msg)
        log.info("request finished", extra={
            "request_id": st.request_id, "finish_reason": reason, "prompt_tokens": len(st.prompt),
            "cached_tokens": st.cached_tokens, "completion_tokens": st.completion_tokens,
            "prefill_worker": st.prefill_worker, "decode_worker": st.decode_worker, "ttft_ms": round(ttft * 1e3, 2),
            "tpot_ms": round(tpot * 1e3, 3), "kv_bytes": st.transfer_bytes})
        return msg


def slo_met(slo: pb.SloTargets | None, ttft: float, tpot: float) -> bool | None:
    """None when the request carried no SLO target."""
    if slo is None or not (slo.HasField("ttft_ms") or slo.HasField("tpot_ms")):
        return None
    return (not slo.HasField("ttft_ms") or ttft * 1e3 <= slo.ttft_ms) and \
           (not slo.HasField("tpot_ms") or tpot * 1e3 <= slo.tpot_ms)
