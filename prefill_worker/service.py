"""The prefill worker: batches prompts (chunked prefill, prefix cache), samples the first
token, ships the request's KV blocks to the decode worker the router chose."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine import InvalidRequestError, LLMEngine
from engine.sequence import SequenceStatus
from pdserve.runtime.convert import params_from_proto, top_to_proto
from pdserve.runtime.worker_server import WorkerRuntime
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wrpc
from prefill_worker.kv_export import pack_export
from transfer import KVSender, TransferState

log = logging.getLogger(__name__)


def _drop(engine: LLMEngine, rid: str) -> None:
    """Free whatever the request still holds: a prefilled sequence's blocks stay cached."""
    seq = engine.seqs.get(rid)
    if seq is None:
        return
    if seq.status is SequenceStatus.PREFILLED:
        engine.release(rid)
    else:
        engine.abort_request(rid)


class PrefillService(wrpc.PrefillWorkerServicer):
    def __init__(self, rt: WorkerRuntime, sender: KVSender) -> None:
        self.rt = rt
        self.sender = sender
        self.bytes_sent = 0

    async def _ship(self, rid: str, request: wpb.PrefillRequest) -> wpb.TransferResult:
        loop, eng = self.rt.engine_loop, self.rt.engine
        t0 = time.monotonic()
        exp = await loop.call(eng.export_kv, rid, request.skip_blocks)
        header, frames = pack_export(exp, eng.kv.data, self.rt.cfg.transfer.max_frame_bytes)
        header.meta["attempt"] = request.attempt
        timeout = request.transfer_timeout_s or self.rt.cfg.transfer.timeout_s
        handle = self.sender.send(request.decode_transfer_address, header, frames, timeout)
        delay = 0.0002
        try:
            while not handle.done:
                self.sender.poll()
                if handle.done:
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.005)
        finally:
            if not handle.done:  # cancelled while waiting: stop tracking it
                self.sender.abandon(handle)
        ok = handle.state is TransferState.DONE
        if ok:
            self.bytes_sent += header.total_bytes
        else:
            log.warning("KV transfer failed", extra={"request_id": rid, "dest": handle.dest, "reason": handle.error})
        return wpb.TransferResult(ok=ok, error=handle.error, bytes=header.total_bytes, blocks=header.num_blocks,
                                  seconds=time.monotonic() - t0)

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
                await loop.call(eng.add_request, rid, list(request.prompt_token_ids), params, True)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            out = await q.get()
            queue_s, prefill_s = await loop.call(eng.request_timings, rid)
            yield wpb.PrefillResponse(first=wpb.FirstToken(
                token_id=out.new_token_ids[0], logprob=out.new_logprobs[0],
                top_logprobs=top_to_proto(out.new_top_logprobs)[0] if out.new_top_logprobs[0] else None,
                text=out.text_delta, finish_reason=out.finish_reason or "", cached_tokens=out.num_cached_tokens,
                queue_s=queue_s, prefill_s=prefill_s))
            if out.finished:
                return
            yield wpb.PrefillResponse(transfer=await self._ship(rid, request))
        finally:
            self.rt.inflight -= 1
            self.rt.served += 1
            loop.close_stream(rid)
            loop.call(_drop, eng, rid)  # not awaited: must run even when this handler was cancelled


def add_to_server(server: grpc.aio.Server, service: PrefillService) -> None:
    wrpc.add_PrefillWorkerServicer_to_server(service, server)



