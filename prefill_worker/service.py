"""The prefill worker: batches prompts (chunked prefill, prefix cache), samples the first
token, ships the request's KV blocks to the decode worker the router chose.

The router hears the first token from here and nothing else: the decode worker is the one
that reports whether the KV arrived (its stream fails on a bad or missing transfer).

A prompt computed in chunks ships its KV in parts as the chunks finish (transfer.stream_min_bytes),
each an ordinary transfer; the last one carries the first token and leaves just before that
token goes to the router. Between the first token and the second there is then only the last
chunk's KV on the wire, not the prompt's (a 2048-token prompt's 32 MiB took 19 ms there on this
machine, its last 512-token chunk's 3-8 ms)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass, field

import grpc

from engine import InvalidRequestError, KVExport, LLMEngine
from engine.sequence import SequenceStatus
from pdcommon.convert import first_token_to_proto, params_from_proto
from pdcommon.grpc_server import add_service
from pdcommon.priority import lower_thread_priority
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc
from pdcommon.worker_runtime import WorkerRuntime
from prefill_worker.kv_export import merge_exports, pack_export
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


@dataclass(slots=True)
class _Shipment:
    """One request's KV on its way: parts the engine exported and not yet sent (held until they
    are worth a transfer), and the transfers in flight with their sizes."""

    held: list[KVExport] = field(default_factory=list)
    transfers: list[tuple[concurrent.futures.Future, int]] = field(default_factory=list)

    def held_bytes(self) -> int:
        return sum(p.num_blocks for p in self.held) * self.held[0].layout.block_nbytes if self.held else 0


class PrefillService(wrpc.PrefillWorkerServicer):
    def __init__(self, rt: WorkerRuntime, sender: KVSender) -> None:
        self.rt = rt
        # The sender runs on a thread of its own: hashing leaves the event loop, and an
        # acknowledgement wakes the waiting handler at once (no sleep-and-look loop).
        self.shipper = SenderLoop(sender, name="kv-sender",
                                  on_start=lambda: lower_thread_priority(rt.cfg.process.kv_nice))
        self.bytes_sent = 0

    def close(self) -> None:
        self.shipper.close()

    def gauges(self) -> dict[str, int]:
        sender = self.shipper.sender
        return {"peer_sockets": getattr(sender, "num_sockets", 0),
                "kv_shared_peers": getattr(sender, "num_shared_peers", 0)}

    def _send(self, request: wpb.PrefillRequest, exp: KVExport, ship: _Shipment) -> None:
        tcfg = self.rt.cfg.transfer
        header, frames = pack_export(exp, request.attempt)
        fut = self.shipper.send(request.decode_transfer_address, header, frames,
                                request.transfer_timeout_s or tcfg.timeout_s, key=request.transfer_key,
                                peer_key=request.decode_transfer_public_key)
        ship.transfers.append((fut, header.total_bytes))

    def _ship_part(self, request: wpb.PrefillRequest, part: KVExport, ship: _Shipment) -> None:
        """A chunk's blocks: sent once the parts held come to transfer.stream_min_bytes."""
        ship.held.append(part)
        floor = self.rt.cfg.kv_stream_min_bytes
        if floor and ship.held_bytes() >= floor:
            self._send(request, merge_exports(ship.held), ship)
            ship.held.clear()

    async def _settle(self, rid: str, ship: _Shipment) -> None:
        """Wait for every transfer of the request to be acknowledged."""
        for fut, nbytes in ship.transfers:
            handle = await asyncio.wrap_future(fut)
            if handle.state is TransferState.DONE:
                self.bytes_sent += nbytes
            else:
                log.warning("KV transfer failed", extra={"request_id": rid, "dest": handle.dest,
                                                         "reason": handle.error})
        ship.transfers.clear()

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            params = params_from_proto(request.sampling)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        loop, eng = self.rt.engine_loop, self.rt.engine
        q = loop.open_stream(rid)
        self.rt.inflight += 1
        ship = _Shipment()
        tcfg = self.rt.cfg.transfer
        try:
            # Streaming, the engine hands over each chunk's KV and the rest with the first token;
            # not (stream_min_bytes 0), the whole KV with the first token, exported in the step
            # that made it. Exported after the first token had gone, by a call to the engine
            # thread, it left 0.5-4 ms later (bench/transfer.py's second-token gap).
            streaming = bool(self.rt.cfg.kv_stream_min_bytes)
            try:
                await loop.call(eng.add_request, rid, list(request.prompt_token_ids), params, True,
                                list(request.resume_token_ids), request.skip_blocks, tcfg.max_frame_bytes,
                                streaming)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            out, _ = await loop.next(q)
            while not out.new_token_ids and not out.finished:  # a chunk done: its KV leaves now
                if out.kv_part is not None:
                    self._ship_part(request, out.kv_part, ship)
                out, _ = await loop.next(q)
            rest = merge_exports([*ship.held, out.kv_part]) if out.kv_part is not None else None
            if rest is not None and streaming:
                # The rest goes out before the first token: it is what the second token waits for.
                self._send(request, rest, ship)
            yield wpb.PrefillResponse(first=first_token_to_proto(out, out.prefill_s))
            if rest is not None and not streaming:
                # The whole KV right after the first token, which its packing and hashing (32 MiB
                # for 2048 tokens of the 50M model) would otherwise hold back on two cores.
                self._send(request, rest, ship)
            await self._settle(rid, ship)
        finally:
            # Cancelled, failed, or finished at its first token (the router then releases the
            # decode worker's reservation): parts still in flight are not waited for.
            for fut, _ in ship.transfers:
                self.shipper.abandon(fut)
            self.rt.inflight -= 1
            self.rt.served += 1
            loop.close_stream(rid, q)
            loop.call(_drop, eng, rid)  # not awaited: must run even when this handler was cancelled


def add_to_server(server: grpc.aio.Server, service: PrefillService) -> None:
    add_service(server, service, wpb.DESCRIPTOR.services_by_name["PrefillWorker"])
