"""The decode worker: reserves blocks for announced requests, lands incoming KV, then runs
the sequences in its continuous-batching loop and streams their tokens."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from decode_worker.kv_import import check_and_land, check_header, land_frame
from engine import InvalidRequestError, KVReservation
from pdserve.runtime.convert import params_from_proto, top_to_proto
from pdserve.runtime.worker_server import WorkerRuntime
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wrpc
from transfer import KVHeader, KVReceiver, ReceivedKV, TransferError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingImport:
    reservation: KVReservation
    arrived: asyncio.Future  # resolves to the header's meta dict, or raises TransferError
    attempt: int = 0


class DecodeService(wrpc.DecodeWorkerServicer):
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.receiver: KVReceiver | None = None
        self.pending: dict[str, PendingImport] = {}
        # Held while a frame is copied into a reservation and while a reservation is withdrawn,
        # so a cancelled request's blocks are never written after they are handed back.
        self._land_lock = threading.Lock()
        self._stop = threading.Event()
        self._aloop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._receive_loop, name="kv-receiver", daemon=True)

    def attach(self, receiver: KVReceiver) -> None:
        """Start receiving. The receiver may stream frames into this service (it is a KVSink)."""
        self.receiver = receiver
        self._thread.start()

    # ---- receiving (its own thread: checks and copies never stall the decode loop) --------------
    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                for rx in self.receiver.poll(0.05):
                    self._land(rx)
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
        return p

    # KVSink: a streaming receiver calls these as the header and each frame arrive.
    def open(self, header: KVHeader) -> None:
        check_header(header, self._pending_for(header).reservation, self.rt.engine.kv.data)

    def frame(self, header: KVHeader, index: int, buf: memoryview) -> None:
        with self._land_lock:
            land_frame(header, index, buf, self._pending_for(header).reservation, self.rt.engine.kv.data)

    def _land(self, rx: ReceivedKV) -> None:
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
                with self._land_lock:
                    self._pending_for(rx.header)  # still reserved?
                    check_and_land(rx.header, rx.frames, p.reservation, self.rt.engine.kv.data)
        except TransferError as e:
            rx.ack(False, str(e))
            self._aloop.call_soon_threadsafe(_resolve, p.arrived, e)
            return
        rx.ack(True)
        self._aloop.call_soon_threadsafe(_resolve, p.arrived, dict(rx.header.meta))

    # ---- the RPC -------------------------------------------------------------------------------
    async def Decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        try:
            params = params_from_proto(request.sampling)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        loop, eng = self.rt.engine_loop, self.rt.engine
        if self.rt.state == "draining":
            yield wpb.DecodeResponse(reservation=wpb.Reservation(ok=False))
            return
        try:
            res = await loop.call(eng.reserve_import, rid, prompt, params, len(prompt) + params.max_tokens)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        st = loop.stats
        if res is None:
            yield wpb.DecodeResponse(reservation=wpb.Reservation(ok=False, num_blocks=st.num_blocks,
                                                                 free_blocks=st.free_blocks))
            return
        t0 = time.monotonic()
        reserved = len(res.block_ids)
        self.rt.reserved_blocks += reserved
        self.rt.inflight += 1
        q = loop.open_stream(rid)
        self.pending[rid] = PendingImport(res, asyncio.get_running_loop().create_future(), request.attempt)
        finished = False
        try:
            yield wpb.DecodeResponse(reservation=wpb.Reservation(
                ok=True, num_held_blocks=res.num_held_blocks, num_blocks=st.num_blocks, free_blocks=st.free_blocks))
            timeout = request.transfer_timeout_s or self.rt.cfg.transfer.timeout_s
            try:
                meta = await asyncio.wait_for(self.pending[rid].arrived, timeout)
            except TimeoutError:
                await context.abort(grpc.StatusCode.ABORTED,
                                    f"KV transfer for {rid} did not arrive within {timeout:.1f}s")
            except TransferError as e:
                await context.abort(grpc.StatusCode.DATA_LOSS, f"KV transfer rejected: {e}")
            self.pending.pop(rid, None)
            kv_s = time.monotonic() - t0
            final = await loop.call(eng.commit_import, rid, int(meta["first_token"]), float(meta["first_logprob"]))
            if final is not None:
                finished = True
                yield wpb.DecodeResponse(tokens=wpb.DecodeTokens(finish_reason=final.finish_reason or "stop",
                                                                 text=final.text_delta, kv_transfer_s=kv_s))
                return
            first = True
            while True:
                out = await q.get()
                finished = out.finished
                yield wpb.DecodeResponse(tokens=wpb.DecodeTokens(
                    token_ids=out.new_token_ids, text=out.text_delta, logprobs=out.new_logprobs,
                    top_logprobs=top_to_proto(out.new_top_logprobs) if any(out.new_top_logprobs) else [],
                    finish_reason=out.finish_reason or "", kv_transfer_s=kv_s if first else 0.0))
                first = False
                if finished:
                    break
        finally:
            with self._land_lock:
                self.pending.pop(rid, None)
            loop.close_stream(rid)
            self.rt.inflight -= 1
            self.rt.served += 1
            self.rt.reserved_blocks -= reserved
            if not finished:
                loop.call(eng.abort_request, rid)

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
    wrpc.add_DecodeWorkerServicer_to_server(service, server)
