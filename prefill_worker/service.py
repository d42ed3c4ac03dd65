"""The prefill worker: batches prompts (chunked prefill, prefix cache), samples the first
token, ships the request's KV blocks to the decode worker the router chose.

The router hears the first token from here and nothing else: the decode worker is the one
that reports whether the KV arrived (its stream fails on a bad or missing transfer)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from engine import InvalidRequestError, LLMEngine
from engine.sequence import SequenceStatus
from pdcommon.convert import first_token_to_proto, params_from_proto
from pdcommon.grpc_server import add_service
from pdcommon.priority import lower_thread_priority
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc
from pdcommon.worker_runtime import WorkerRuntime
from prefill_worker.kv_export import pack_export
from transfer import KVSender, SenderLoop, TransferState

log = logging.getLogger(__name__)


def _drop(engine: LLMEngine, rid: str) -> None:
    """Free whatever the request still holds: a prefilled sequence's blocks stay cached."""
    seq = engine.seqs.get(rid)
    if seq is None:
        return
    if seq.status is SequenceStatus.PREFILLED:
        engine.release(rid)
    else:
        engine.abort_request(rid, notify=False)


class PrefillService(wrpc.PrefillWorkerServicer):
    def __init__(self, rt: WorkerRuntime, sender: KVSender) -> None:
        self.rt = rt
        # The sender runs on a thread of its own: hashing leaves the event loop, and an
        # acknowledgement wakes the waiting handler at once (no sleep-and-look loop).
        self.shipper = SenderLoop(sender, name="kv-sender",
                                  on_start=lambda: lower_thread_priority(rt.cfg.process.io_nice))
        self.bytes_sent = 0

    def close(self) -> None:
        self.shipper.close()

    def gauges(self) -> dict[str, int]:
        return {"peer_sockets": getattr(self.shipper.sender, "num_sockets", 0)}

    async def _ship(self, rid: str, request: wpb.PrefillRequest) -> None:
        loop, eng, tcfg = self.rt.engine_loop, self.rt.engine, self.rt.cfg.transfer
        exp = await loop.call(eng.export_kv, rid, request.skip_blocks, tcfg.max_frame_bytes)
        header, frames = pack_export(exp, request.attempt)
        fut = self.shipper.send(request.decode_transfer_address, header, frames,
                                request.transfer_timeout_s or tcfg.timeout_s, key=request.transfer_key,
                                peer_key=request.decode_transfer_public_key)
        try:
            handle = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the request was cancelled: stop tracking its transfer
            self.shipper.abandon(fut)
            raise
        if handle.state is TransferState.DONE:
            self.bytes_sent += header.total_bytes
        else:
            log.warning("KV transfer failed", extra={"request_id": rid, "dest": handle.dest, "reason": handle.error})

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            params = params_from_proto(request.sampling)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        loop, eng = self.rt.engine_loop, self.rt.engine
        q = loop.open_stream(rid)
        self.rt.inflight += 1
        try:
            try:
                await loop.call(eng.add_request, rid, list(request.prompt_token_ids), params, True,
                                list(request.resume_token_ids))
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            out, _ = await loop.next(q)
            yield wpb.PrefillResponse(first=first_token_to_proto(out, out.prefill_s))
            if not out.finished:
                await self._ship(rid, request)
        finally:
            self.rt.inflight -= 1
            self.rt.served += 1
            loop.close_stream(rid, q)
            loop.call(_drop, eng, rid)  # not awaited: must run even when this handler was cancelled


def add_to_server(server: grpc.aio.Server, service: PrefillService) -> None:
    add_service(server, service, wpb.DESCRIPTOR.services_by_name["PrefillWorker"])
