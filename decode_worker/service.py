"""The decode worker: reserves blocks for announced requests, lands incoming KV, then runs
the sequences in its continuous-batching loop and streams their tokens.

A colocated worker is the same service with `prefill_here` requests (vLLM's kv_both role): it
computes the prompt itself, so no KV arrives and the first token comes from its own engine."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from decode_worker.kv_import import check_header, frame_offset
from engine import InvalidRequestError, KVReservation, LLMEngine, SamplingParams
from engine.llm_engine import KVImportError
from pdcommon.convert import first_token_to_proto, params_from_proto, tokens_to_proto
from pdcommon.engine_loop import DirectStream
from pdcommon.grpc_server import add_service
from pdcommon.priority import lower_thread_priority
from pdcommon.token_stream import FIRST
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc
from pdcommon.worker_runtime import WorkerRuntime
from transfer import KVHeader, KVReceiver, ReceivedKV, TransferError, verify

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingImport:
    """A reservation's incoming KV, whole or in parts (decode_worker/kv_import.py), which the
    receiver's threads (gRPC: several) hand over under `lock`."""

    reservation: KVReservation
    arrived: asyncio.Future  # resolves to (header meta, bytes, seconds), or raises TransferError
    attempt: int = 0
    key: bytes = b""  # the reservation's one-time transfer key: only KV signed with it lands
    # When the header of the transfer with the first token arrived (monotonic): the time the
    # second token waits for starts there (parts before it landed while the prompt was computed).
    opened: float = 0.0
    claimed: bytearray = field(default_factory=bytearray)  # per missing block: a part has it
    landed: int = 0  # blocks of completed transfers
    nbytes: int = 0
    meta: dict | None = None  # the header meta with the first token, once that part is complete
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class DecodeService(wrpc.DecodeWorkerServicer):
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.receiver: KVReceiver | None = None
        self.pending: dict[str, PendingImport] = {}
        self.promised = 0  # blocks promised to requests prefilled here (prompt + max_tokens each)
        self._stop = threading.Event()
        self._aloop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._receive_loop, name="kv-receiver", daemon=True)

    def attach(self, receiver: KVReceiver) -> None:
        """Start receiving. The receiver may stream frames into this service (it is a KVSink)."""
        self.receiver = receiver
        self._thread.start()

    # ---- receiving (its own thread: checks and copies never stall the decode loop) --------------
    def _receive_loop(self) -> None:
        lower_thread_priority(self.rt.cfg.process.kv_nice)  # checks and copies give way to the engine
        while not self._stop.is_set():
            try:
                # Wakes as soon as KV arrives; the timeout only paces expiry of stalled transfers
                # (and an idle worker wakes twice a second, not twenty times).
                for rx in self.receiver.poll(0.5):
                    self._complete(rx)
            except Exception:
                log.exception("KV receiver loop error")

    def _pending_for(self, header: KVHeader) -> PendingImport:
        rid = header.request_id
        p = self.pending.get(rid)
        if p is None:
            raise TransferError(f"{rid}: no open reservation (cancelled or timed out)")
        if header.meta.get("attempt", 0) != p.attempt:
            # A late transfer of an earlier attempt: refuse it without touching this reservation.
            raise TransferError(f"{rid}: stale transfer of attempt {header.meta.get('attempt')}, expected {p.attempt}")
        if p.failed:
            raise TransferError(f"{rid}: an earlier part of this KV failed")
        return p

    def _land(self, header: KVHeader, index: int, buf: memoryview, res: KVReservation) -> None:
        offset = header.first_block - res.num_held_blocks + frame_offset(header, index)
        try:
            self.rt.engine.land_kv(res, offset, buf)
        except KVImportError as e:
            raise TransferError(str(e)) from e

    @staticmethod
    def _check(header: KVHeader, p: PendingImport) -> None:
        with p.lock:
            check_header(header, p.reservation, p.claimed)
            if "first_token" in header.meta:
                p.opened = time.monotonic()

    def transfer_key(self, header: KVHeader) -> bytes:
        """The receiver's key lookup: KV for no open reservation is refused before any check."""
        return self._pending_for(header).key

    # KVSink: a streaming receiver calls these as the header and each frame arrive.
    def open(self, header: KVHeader) -> None:
        self._check(header, self._pending_for(header))

    def frame(self, header: KVHeader, index: int, buf: memoryview) -> None:
        self._land(header, index, buf, self._pending_for(header).reservation)

    def _complete(self, rx: ReceivedKV) -> None:
        """A transfer is complete (landed frame by frame already, or delivered whole)."""
        try:
            p = self._pending_for(rx.header)
        except TransferError as e:
            rx.ack(False, str(e))
            return
        try:
            if rx.error:
                raise TransferError(rx.error)
            if not rx.landed:
                verify(rx.header, rx.frames)
                self._check(rx.header, p)
                for i, buf in enumerate(rx.frames):
                    self._land(rx.header, i, buf, p.reservation)
        except TransferError as e:
            p.failed = True
            rx.ack(False, str(e))
            self._aloop.call_soon_threadsafe(_resolve, p.arrived, e)
            return
        rx.ack(True)
        with p.lock:
            p.landed += rx.header.num_blocks
            p.nbytes += rx.header.total_bytes
            if "first_token" in rx.header.meta:
                p.meta = dict(rx.header.meta)
            done = p.meta is not None and p.landed == len(p.reservation.missing_block_ids)
        if done:
            # The transfer's own time: the last part's header in to every frame landed (a
            # transfer delivered whole has no earlier sign of it than now). Counted from the
            # decode request instead, it held the prefill as well (the reservation is made
            # before the prompt is computed); from the first part, it would hold most of it.
            took = time.monotonic() - p.opened if p.opened else 0.0
            self._aloop.call_soon_threadsafe(_resolve, p.arrived, (p.meta, p.nbytes, took))

    # ---- admission (engine thread) ---------------------------------------------------------------
    def _admit_local(self, eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
                     resume: list[int]) -> int:
        """Blocks promised to a request prefilled here, or 0 when the pool cannot promise them: a
        promised request is never preempted."""
        need = eng.bm.blocks_needed(len(prompt) + params.max_tokens)
        eng.validate(prompt, params)
        if self.promised + need > eng.bm.num_blocks or not eng.scheduler.has_free_slot:
            return 0
        eng.add_request(rid, prompt, params, False, resume)
        self.promised += need
        return need

    # ---- the RPC -------------------------------------------------------------------------------
    async def Decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid, loop, eng = request.request_id, self.rt.engine_loop, self.rt.engine
        try:
            params = params_from_proto(request.sampling)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not request.prefill_here and len(request.transfer_key) < 16:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a reservation for imported KV needs a "
                                "transfer_key of at least 16 bytes (the router makes one per attempt)")
        if self.rt.state == "draining":
            yield wpb.DecodeResponse(reservation=wpb.Reservation(ok=False))
            return
        local, direct = request.prefill_here, self._direct(request)
        q = loop.open_stream(rid, direct)
        held, blocks, res = await self._reserve(request, params, q, context)
        if not blocks:
            loop.close_stream(rid, q)
            yield wpb.DecodeResponse(reservation=wpb.Reservation(ok=False, free_blocks=self._free_blocks()))
            return
        if not local:
            self.pending[rid] = PendingImport(res, self._aloop.create_future(), request.attempt,
                                              bytes(request.transfer_key),
                                              claimed=bytearray(len(res.missing_block_ids)))
        self.rt.reserved_blocks += blocks
        self.rt.inflight += 1
        finished = False
        try:
            yield wpb.DecodeResponse(reservation=wpb.Reservation(ok=True, num_held_blocks=held,
                                                                 free_blocks=self._free_blocks()))
            # Prefilled here with tokens direct: the engine thread sends the first token, or it
            # comes below (at FIRST) when it cannot.
            if not (local and direct is not None):
                first = self._first_local(rid, q) if local else \
                    self._first_imported(rid, request, context, q, direct is not None)
                async for msg in first:
                    finished = _finishes(msg)
                    yield msg
            if not finished:
                async with aclosing(self._decoded(q)) as decoded:
                    async for msg in decoded:
                        finished = _finishes(msg)
                        yield msg
        finally:
            self.pending.pop(rid, None)
            loop.close_stream(rid, q)
            self.rt.inflight -= 1
            self.rt.served += 1
            self.rt.reserved_blocks -= blocks
            if local:
                self.promised -= blocks
            if not finished:
                loop.call(eng.abort_request, rid, False)

    async def _reserve(self, request: wpb.DecodeRequest, params: SamplingParams, q, context,
                       ) -> tuple[int, int, KVReservation | None]:
        """(blocks already held, blocks reserved, the import's reservation or None): prompt and
        max_tokens' blocks for KV imported from a prefill worker, or admitted to prefill here.
        No blocks: no room."""
        rid, prompt, resume = request.request_id, list(request.prompt_token_ids), list(request.resume_token_ids)
        loop, eng = self.rt.engine_loop, self.rt.engine
        try:
            if request.prefill_here:
                return 0, await loop.call(self._admit_local, eng, rid, prompt, params, resume), None
            res = await loop.call(eng.reserve_import, rid, prompt, params, len(prompt) + params.max_tokens, resume)
            return (res.num_held_blocks, len(res.block_ids), res) if res is not None else (0, 0, None)
        except InvalidRequestError as e:
            loop.close_stream(rid, q)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:
            # Cancelled while the engine thread admits it: whatever it reserves is freed after it
            # (commands run in order), so a cancel during reservation leaks nothing.
            loop.close_stream(rid, q)
            loop.call(eng.abort_request, rid, False)
            raise

    async def _decoded(self, q):
        """The engine's tokens for the stream, as messages, up to the one that finishes it."""
        loop = self.rt.engine_loop
        while True:
            out, index = await loop.next(q)
            if index == FIRST:  # the first token, where it could not go direct (it ends the stream, say)
                yield wpb.DecodeResponse(first=first_token_to_proto(out, out.prefill_s))
                if out.finished:
                    return
                continue
            outs = [out]
            # The engine got ahead: send what is ready in one message (a direct stream's items
            # here are not consecutive: each keeps its own index).
            while index is None and not outs[-1].finished and (item := loop.take_ready(q)) is not None:
                outs.append(item[0])
            yield wpb.DecodeResponse(tokens=tokens_to_proto(outs, index=index or 0))
            if outs[-1].finished:
                return

    def _direct(self, request: wpb.DecodeRequest) -> DirectStream | None:
        """Where this stream's tokens go (all but the last), when the router asked for its token port."""
        if not request.token_port or len(request.token_key) < 16:
            return None
        host = self.rt.router_address.rsplit(":", 1)[0]  # the router as this worker reaches it
        return DirectStream(f"tcp://{host}:{request.token_port}", request.request_id, request.attempt,
                            bytes(request.token_key), count_first=not request.prefill_here)

    async def _first_local(self, rid: str, q: asyncio.Queue):
        out, _ = await self.rt.engine_loop.next(q)  # the timing rides on the output: no trip to a busy engine thread
        yield wpb.DecodeResponse(first=first_token_to_proto(out, out.prefill_s))

    async def _first_imported(self, rid: str, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext,
                              q: asyncio.Queue, direct: bool):
        """Wait for the KV, commit the sequence; the first message carries the transfer's figures,
        and, unless tokens go direct (the engine thread sends them, the first one too), the
        first decoded token."""
        timeout = request.transfer_timeout_s or self.rt.cfg.transfer.timeout_s
        try:
            meta, nbytes, took = await asyncio.wait_for(self.pending[rid].arrived, timeout)
        except TimeoutError:
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} did not arrive within {timeout:.1f}s")
        except TransferError as e:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"KV transfer rejected: {e}")
        self.pending.pop(rid, None)
        kv = {"kv_transfer_s": took, "kv_transfer_bytes": nbytes}
        if direct:
            # The figures leave before the commit, while the engine has nothing of this request
            # to step. Sent after it, their write (and the router reading them) ran beside the
            # sequence's first decode step, whose two threads had both cores: that step took 2x
            # its time now and then. 2048-token prompts, 1P+1D, the two orders on two clusters
            # in turn (14 each): the second token more than 2 ITLs after the first 1 time against
            # 5, gap / ITL median 1.73 against 1.88 (the typical gap 0.5 ms longer, the write
            # now before the step).
            yield wpb.DecodeResponse(tokens=wpb.DecodeTokens(**kv))
            kv = {}  # sent: the messages below need not repeat them
        final = await self.rt.engine_loop.call(self.rt.engine.commit_import, rid, int(meta["first_token"]),
                                               float(meta["first_logprob"]))
        if final is not None:  # the router takes figures-only messages apart from the stream's last
            yield wpb.DecodeResponse(tokens=wpb.DecodeTokens(finish_reason=final.finish_reason or "stop",
                                                             text=final.text_delta, **kv))
            return
        if direct:
            return
        out, _ = await self.rt.engine_loop.next(q)
        yield wpb.DecodeResponse(tokens=tokens_to_proto([out], **kv))

    def gauges(self) -> dict[str, int]:
        return {"partial_transfers": getattr(self.receiver, "num_partial", 0)}

    def _free_blocks(self) -> int:
        st = self.rt.engine_loop.stats
        return st.num_blocks - self.promised if self.rt.role == "colocated" else st.free_blocks

    def close(self) -> None:
        self._stop.set()
        if self.receiver is not None:
            self._thread.join(timeout=2)
            self.receiver.close()


def _resolve(fut: asyncio.Future, value) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


def add_to_server(server: grpc.aio.Server, service: DecodeService) -> None:
    add_service(server, service, wpb.DESCRIPTOR.services_by_name["DecodeWorker"])


def _finishes(msg: wpb.DecodeResponse) -> bool:
    """Whether a message carries the stream's last token."""
    return (msg.HasField("tokens") and bool(msg.tokens.finish_reason)
            or msg.HasField("first") and bool(msg.first.finish_reason))
