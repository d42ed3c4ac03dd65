"""The request path: admission on a decode worker, prefill, first token to the client at once,
KV transfer prefill -> decode, then the decode stream relayed to the client."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field

import grpc

from engine import InvalidRequestError, SamplingParams
from engine.hashing import hash_blocks
from pdserve.config import ClusterConfig
from pdserve.runtime.convert import params_from_proto, params_to_proto
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from router.launcher import Launcher
from router.membership import Membership, WorkerRecord
from router.model_info import ModelInfo
from router.policy import make_policy

log = logging.getLogger(__name__)
PREFIX_BLOCKS = 64  # leading blocks tracked for prefix-aware routing


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    deadline: float
    arrival: float
    slo: pb.SloTargets | None = None
    prefix: list[int] = field(default_factory=list)
    failure: RequestFailed | None = None
    calls: list = field(default_factory=list)  # open worker calls, cancelled on failure
    first_sent: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    attempt: int = 0

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        if self.failure is None:
            self.failure = RequestFailed(code, message)
        for call in self.calls:
            call.cancel()

    @property
    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class RouterCore:
    def __init__(self, cfg: ClusterConfig, launcher: Launcher | None = None, model: ModelInfo | None = None) -> None:
        self.cfg = cfg
        self.model = model or ModelInfo.load(cfg.model, cfg.engine.max_model_len)
        self.members = Membership(cfg.heartbeat.dead_after_s)
        self.policy = make_policy(cfg.router.routing)
        self.launcher = launcher
        self.block_size = cfg.engine.block_size
        self.waiting = 0
        self.active: dict[str, RequestState] = {}
        self.targets = {role: cfg.pool(role).replicas for role in cfg.roles}
        self.observers: list = []  # objects with on_token(st, n, now) / on_finish(st, msg) / on_fail(st, err)
        self.http_address = ""

    @property
    def admission_role(self) -> str:
        """The pool whose workers hold a request's KV for its whole life."""
        return "colocated" if self.cfg.mode == "colocated" else "decode"

    def ready(self) -> bool:
        return all(self.members.active(role) for role in self.cfg.roles)

    # ---- input ---------------------------------------------------------------------------------
    def parse(self, request: pb.GenerateRequest, time_remaining: float | None) -> RequestState:
        """Validate and tokenize; a rejected request is counted like any other failure."""
        try:
            return self._parse(request, time_remaining)
        except RequestFailed as e:
            for ob in self.observers:
                ob.on_fail(None, e)
            raise

    def _parse(self, request: pb.GenerateRequest, time_remaining: float | None) -> RequestState:
        which = request.WhichOneof("prompt")
        if which is None:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "request has no prompt: set text or token_ids")
        if which == "text":
            if not request.text:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            prompt = self.model.encode(request.text)
        else:
            prompt = list(request.token_ids.ids)
            if not prompt:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            bad = next((t for t in prompt if t >= self.model.vocab_size), None)
            if bad is not None:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt token id {bad} is outside the vocabulary [0, {self.model.vocab_size})")
        try:
            params = params_from_proto(request.sampling)
        except InvalidRequestError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        total = len(prompt) + params.max_tokens
        if total > self.model.max_model_len:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                                f"the model's context length {self.model.max_model_len}")
        if params.seed is None and not params.greedy:
            # Fixing the seed here makes a retried request draw the same tokens.
            params.seed = random.getrandbits(62)
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.active:
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already in flight")
        now = time.monotonic()
        limit = min(time_remaining if time_remaining is not None else math.inf, self.cfg.router.request_timeout_s)
        st = RequestState(rid, prompt, params, now + limit, now, request.slo if request.HasField("slo") else None)
        st.prefix = hash_blocks(prompt, self.block_size)[:PREFIX_BLOCKS]
        return st

    # ---- admission -----------------------------------------------------------------------------
    async def _reserve(self, st: RequestState, exclude: set[str]) -> tuple[WorkerRecord, object, wpb.Reservation]:
        """Open a decode stream on a worker with room. Waits in the bounded queue until one has
        room or the deadline passes; a decode worker is never asked for more than it has."""
        need = -(-(len(st.prompt) + st.params.max_tokens) // self.block_size)
        queued = False
        try:
            while True:
                role = self.admission_role
                ranked = self.policy.rank_decode(self.members.active(role), st.prefix, need)
                # After a failed attempt, other workers first; the same one only as a last resort.
                ranked = [w for w in ranked if w.worker_id not in exclude] + \
                         [w for w in ranked if w.worker_id in exclude]
                for w in ranked:
                    method = w.stub.Generate if role == "colocated" else w.stub.Decode
                    call = method(wpb.DecodeRequest(
                        request_id=st.request_id, prompt_token_ids=st.prompt, sampling=params_to_proto(st.params),
                        transfer_timeout_s=self.cfg.transfer.timeout_s, attempt=st.attempt),
                        timeout=max(st.remaining, 0.001))
                    # Count the request against the worker now, so concurrent admissions spread out.
                    w.inflight[st.request_id] = st.fail
                    try:
                        first = await call.read()
                    except grpc.aio.AioRpcError as e:
                        w.inflight.pop(st.request_id, None)
                        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                            raise RequestFailed(e.code(), e.details()) from e
                        if e.code() == grpc.StatusCode.UNAVAILABLE:
                            self.members.drop(w.worker_id, f"unreachable ({e.details()})")
                        continue
                    if first is grpc.aio.EOF or not first.reservation.ok:
                        w.inflight.pop(st.request_id, None)
                        if first is not grpc.aio.EOF:
                            w.observe_free(first.reservation.free_blocks)
                        call.cancel()
                        continue
                    w.pending_blocks += need - first.reservation.num_held_blocks
                    return w, call, first.reservation
                if not queued:
                    if self.waiting >= self.cfg.router.queue_size:
                        raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"router queue full ({self.waiting} waiting); retry later")
                    queued = True
                    self.waiting += 1
                if st.remaining <= 0:
                    raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"no decode worker had room for {need} KV blocks before the deadline")
                self.members.changed.clear()
                try:
                    await asyncio.wait_for(self.members.changed.wait(), min(st.remaining, 1.0))
                except TimeoutError:
                    pass
        finally:
            if queued:
                self.waiting -= 1

    # ---- the request path ----------------------------------------------------------------------
    async def generate(self, st: RequestState):
        """Yields GenerateResponse messages; raises RequestFailed with a status for the client."""
        self.active[st.request_id] = st
        tried: set[str] = set()
        attempt_fn = self._attempt_colocated if self.cfg.mode == "colocated" else self._attempt
        try:
            for attempt in range(self.cfg.router.max_retries + 1):
                st.attempt = attempt
                retry = False
                async for msg in attempt_fn(st, tried):
                    if msg is None:  # the attempt failed before decode streamed anything: retry
                        retry = True
                        break
                    yield msg
                if not retry:
                    break
                if attempt == self.cfg.router.max_retries:
                    raise st.failure or RequestFailed(grpc.StatusCode.UNAVAILABLE, "request failed")
                log.warning("retrying request", extra={"request_id": st.request_id,
                                                        "reason": st.failure and st.failure.message})
                st.failure = None
        except RequestFailed as e:
            log.info("request failed", extra={"request_id": st.request_id, "code": e.code.name, "reason": e.message,
                                              "prefill_worker": st.prefill_worker, "decode_worker": st.decode_worker})
            for ob in self.observers:
                ob.on_fail(st, e)
            raise
        finally:
            self.active.pop(st.request_id, None)
            for call in st.calls:
                call.cancel()
            self.members.notify()

    async def _attempt(self, st: RequestState, tried: set[str]):
        t_adm = time.monotonic()
        dw, dcall, res = await self._reserve(st, tried)
        st.calls = [dcall]
        pw = self.policy.pick_prefill(self.members.active("prefill"), st.prefix)
        if pw is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available")
        pw.inflight[st.request_id] = st.fail
        st.prefill_worker, st.decode_worker = pw.worker_id, dw.worker_id
        self.policy.record(st.prefix, pw.worker_id, dw.worker_id)
        transfer: asyncio.Future | None = None
        pending_read: asyncio.Future | None = None
        try:
            pcall = pw.stub.Prefill(wpb.PrefillRequest(
                request_id=st.request_id, prompt_token_ids=st.prompt, sampling=params_to_proto(st.params),
                decode_transfer_address=dw.transfer_address, skip_blocks=res.num_held_blocks,
                transfer_timeout_s=self.cfg.transfer.timeout_s, attempt=st.attempt),
                timeout=max(st.remaining, 0.001))
            st.calls.append(pcall)
            first = await self._read(st, pcall, pw)
            if first is grpc.aio.EOF:
                raise RequestFailed(grpc.StatusCode.INTERNAL, f"prefill worker {pw.worker_id} closed the stream")
            ft = first.first
            st.cached_tokens, st.prefill_s = ft.cached_tokens, ft.prefill_s
            st.queue_s = (time.monotonic() - t_adm - ft.prefill_s) if st.first_sent is None else st.queue_s
            if st.first_sent is None:
                st.first_sent = st.last_token = time.monotonic()
                st.completion_tokens = 1
                msg = pb.GenerateResponse(request_id=st.request_id, token_ids=[ft.token_id], text=ft.text,
                                          logprobs=[ft.logprob], prefill_worker=pw.worker_id,
                                          decode_worker=dw.worker_id)
                if ft.HasField("top_logprobs"):
                    msg.top_logprobs.append(ft.top_logprobs)
                if ft.finish_reason:
                    yield self._finish(msg, st, ft.finish_reason)
                    return
                yield msg
            elif ft.finish_reason:
                yield self._finish(pb.GenerateResponse(request_id=st.request_id), st, ft.finish_reason)
                return
            # The transfer outcome (prefill side) and the decode stream race: watch both.
            transfer = asyncio.ensure_future(self._read(st, pcall, pw))
            streamed = False
            while True:
                if pending_read is None:
                    pending_read = asyncio.ensure_future(self._read(st, dcall, dw))
                if transfer is not None:
                    done, _ = await asyncio.wait({transfer, pending_read}, return_when=asyncio.FIRST_COMPLETED)
                    if transfer in done:
                        try:
                            result = transfer.result()
                        except RequestFailed:  # the decode side failed first and cancelled the prefill call
                            result = None
                        transfer = None
                        if result is None or result is grpc.aio.EOF or not result.transfer.ok:
                            if result is None:
                                err = st.failure.message if st.failure else "prefill call failed"
                            else:
                                err = "prefill stream ended" if result is grpc.aio.EOF else result.transfer.error
                            st.fail(grpc.StatusCode.UNAVAILABLE, f"KV transfer to {dw.worker_id} failed: {err}")
                            tried.add(dw.worker_id)
                            yield None
                            return
                        st.transfer_bytes = result.transfer.bytes
                        st.transfer_s = result.transfer.seconds
                        continue
                try:
                    msg = await pending_read
                except RequestFailed:
                    if not streamed and st.failure is not None and st.failure.code != grpc.StatusCode.CANCELLED:
                        tried.add(dw.worker_id)
                        yield None
                        return
                    raise
                pending_read = None
                if msg is grpc.aio.EOF:
                    raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {dw.worker_id} ended the stream "
                                                                  "without a finish reason")
                tok = msg.tokens
                streamed = True
                self._tokens(st, len(tok.token_ids))
                out = pb.GenerateResponse(request_id=st.request_id, token_ids=tok.token_ids, text=tok.text,
                                          logprobs=tok.logprobs, top_logprobs=tok.top_logprobs)
                if tok.finish_reason:
                    yield self._finish(out, st, tok.finish_reason)
                    return
                yield out
        finally:
            for fut in (transfer, pending_read):
                if fut is not None:
                    _discard(fut)
            dw.inflight.pop(st.request_id, None)
            pw.inflight.pop(st.request_id, None)
            dw.served += 1
            pw.served += 1

    async def _attempt_colocated(self, st: RequestState, tried: set[str]):
        """Colocated mode: one worker computes both phases; the stream is relayed as it comes."""
        t_adm = time.monotonic()
        w, call, _ = await self._reserve(st, tried)
        st.calls = [call]
        st.prefill_worker = st.decode_worker = w.worker_id
        self.policy.record(st.prefix, w.worker_id, w.worker_id)
        try:
            while True:
                msg = await self._read(st, call, w)
                if msg is grpc.aio.EOF:
                    raise RequestFailed(grpc.StatusCode.INTERNAL, f"worker {w.worker_id} ended the stream early")
                tok = msg.tokens
                if st.first_sent is None:
                    st.first_sent = st.last_token = time.monotonic()
                    st.completion_tokens = len(tok.token_ids)
                    st.cached_tokens, st.prefill_s = tok.cached_tokens, tok.prefill_s
                    st.queue_s = max(st.first_sent - t_adm - tok.prefill_s, 0.0)
                else:
                    self._tokens(st, len(tok.token_ids))
                out = pb.GenerateResponse(request_id=st.request_id, token_ids=tok.token_ids, text=tok.text,
                                          logprobs=tok.logprobs, top_logprobs=tok.top_logprobs,
                                          prefill_worker=w.worker_id, decode_worker=w.worker_id)
                if tok.finish_reason:
                    yield self._finish(out, st, tok.finish_reason)
                    return
                yield out
        finally:
            w.inflight.pop(st.request_id, None)
            w.served += 1

    def _tokens(self, st: RequestState, n: int) -> None:
        now = time.monotonic()
        for ob in self.observers:
            ob.on_token(st, n, now)
        st.completion_tokens += n
        st.last_token = now

    async def _read(self, st: RequestState, call, worker: WorkerRecord):
        try:
            return await call.read()
        except asyncio.CancelledError:
            if st.failure is not None:
                raise st.failure from None
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE,):
                self.members.drop(worker.worker_id, f"failed mid-request ({e.details()})")
                st.fail(grpc.StatusCode.UNAVAILABLE, f"{worker.role} worker {worker.worker_id} failed: {e.details()}")
            elif e.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED):
                # The decode worker rejected or never got the KV: a transfer failure, retryable.
                st.fail(grpc.StatusCode.UNAVAILABLE, f"KV transfer to {worker.worker_id} failed: {e.details()}")
            elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and st.remaining <= 0:
                st.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline exceeded")
            else:
                st.fail(e.code(), f"{worker.role} worker {worker.worker_id}: {e.details()}")
            raise st.failure from None

    def _finish(self, msg: pb.GenerateResponse, st: RequestState, reason: str) -> pb.GenerateResponse:
        now = time.monotonic()
        st.last_token = now
        msg.finish_reason = reason
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(st.prompt), cached_tokens=st.cached_tokens,
                                    completion_tokens=st.completion_tokens, kv_transfer_bytes=st.transfer_bytes))
        ttft = (st.first_sent or now) - st.arrival
        tpot = (now - st.first_sent) / (st.completion_tokens - 1) if st.first_sent and st.completion_tokens > 1 else 0.0
        msg.timings.CopyFrom(pb.Timings(queue=max(st.queue_s, 0.0), prefill=st.prefill_s, kv_transfer=st.transfer_s,
                                        ttft=ttft, tpot=tpot, e2e=now - st.arrival))
        msg.prefill_worker, msg.decode_worker = st.prefill_worker, st.decode_worker
        met = True
        if st.slo is not None:
            met = (not st.slo.HasField("ttft_ms") or ttft * 1e3 <= st.slo.ttft_ms) and \
                  (not st.slo.HasField("tpot_ms") or tpot * 1e3 <= st.slo.tpot_ms)
        msg.slo_met = met
        for ob in self.observers:
            ob.on_finish(st, msg)
        log.info("request finished", extra={
            "request_id": st.request_id, "finish_reason": reason, "prompt_tokens": len(st.prompt),
            "cached_tokens": st.cached_tokens, "completion_tokens": st.completion_tokens,
            "prefill_worker": st.prefill_worker, "decode_worker": st.decode_worker, "ttft_ms": round(ttft * 1e3, 2),
            "tpot_ms": round(tpot * 1e3, 3), "kv_bytes": st.transfer_bytes})
        return msg


def _discard(fut: asyncio.Future) -> None:
    """Drop a helper future: cancel it if pending and consume its outcome, so a failure that
    nobody awaits is not reported as an unretrieved task exception."""
    if not fut.done():
        fut.cancel()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
