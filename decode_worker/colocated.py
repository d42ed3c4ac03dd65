"""Colocated mode: one worker runs both phases (chunked prefill mixed into its decode batches),
so no KV moves. It exists to compare against disaggregated serving on the same hardware.

Admission reserves what each request can grow to (prompt + max_tokens) against the pool, so
a running request is never preempted: a worker without room says so and the router queues."""

from __future__ import annotations

import asyncio

import grpc

from engine import InvalidRequestError, LLMEngine
from pdserve.config import ClusterConfig
from pdserve.runtime.convert import params_from_proto, top_to_proto
from pdserve.runtime.worker_server import WorkerRuntime
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wrpc


class ColocatedService(wrpc.ColocatedWorkerServicer):
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.promised = 0  # blocks promised to admitted requests

    def _admit(self, eng: LLMEngine, rid: str, prompt: list[int], params, need: int) -> bool:
        if self.promised + need > eng.bm.num_blocks:
            return False
        eng.add_request(rid, prompt, params)
        self.promised += need
        return True

    async def Generate(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        loop, eng = self.rt.engine_loop, self.rt.engine
        try:
            params = params_from_proto(request.sampling)
            need = eng.bm.blocks_needed(len(prompt) + params.max_tokens)
            q = loop.open_stream(rid)
            ok = await loop.call(self._admit, eng, rid, prompt, params, need)
        except InvalidRequestError as e:
            loop.close_stream(rid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        st = loop.stats
        if not ok or self.rt.state == "draining":
            loop.close_stream(rid)
            yield wpb.DecodeResponse(reservation=wpb.Reservation(ok=False, num_blocks=st.num_blocks,
                                                                 free_blocks=st.num_blocks - self.promised))
            return
        self.rt.inflight += 1
        self.rt.reserved_blocks += need
        finished = False
        try:
            yield wpb.DecodeResponse(reservation=wpb.Reservation(ok=True, num_blocks=st.num_blocks,
                                                                 free_blocks=st.num_blocks - self.promised))
            first = True
            while True:
                out = await q.get()
                finished = out.finished
                tok = wpb.DecodeTokens(token_ids=out.new_token_ids, text=out.text_delta, logprobs=out.new_logprobs,
                                       top_logprobs=top_to_proto(out.new_top_logprobs) if any(out.new_top_logprobs)
                                       else [], finish_reason=out.finish_reason or "")
                if first:
                    seq_times = await loop.call(eng.request_timings, rid)
                    tok.queue_s, tok.prefill_s = seq_times
                    tok.cached_tokens = out.num_cached_tokens
                    first = False
                yield wpb.DecodeResponse(tokens=tok)
                if finished:
                    break
        finally:
            self.promised -= need
            self.rt.inflight -= 1
            self.rt.served += 1
            self.rt.reserved_blocks -= need
            loop.close_stream(rid)
            if not finished:
                loop.call(eng.abort_request, rid)


async def serve(cfg: ClusterConfig, worker_id: str, router_address: str, stop: asyncio.Event | None = None,
                started: asyncio.Future | None = None) -> None:
    rt = WorkerRuntime(cfg, "colocated", worker_id, router_address)
    service = ColocatedService(rt)
    rt.service = service
    await rt.run(lambda server: wrpc.add_ColocatedWorkerServicer_to_server(service, server), stop, started)
