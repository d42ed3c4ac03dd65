"""Reading a worker's call for one request: what a broken, cancelled or silent call means for the
request (RetryAttempt on other workers, or RequestFailed for the client), and a decode worker's
tokens from its two channels put back in order.

A decode worker's engine thread sends most tokens straight to the router (pdcommon/token_stream.py);
the gRPC call carries the last one, any error, the KV's figures and whatever the engine thread
could not send. `direct_chunks` merges both; `call_chunks` reads the call alone. A stream silent
for the stall timeout is a hung worker: it leaves the pool and the request moves."""

from __future__ import annotations

import asyncio

import grpc

from pdcommon.token_stream import FIRST, InOrder, TokenChunk
from pdcommon.v1 import worker_pb2 as wpb
from router.admission import Lease
from router.membership import Membership, WorkerRecord
from router.request import RequestFailed, RequestState, RetryAttempt, client_cancelled

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED)


class WorkerStreams:
    def __init__(self, members: Membership, stall_s: float) -> None:
        self.members = members
        self.stall_s = stall_s  # the longest wait for a decode stream's next token (router.stall_timeout_s)

    async def read(self, st: RequestState, call, worker: WorkerRecord, stall_s: float | None = None):
        """One message from a worker call; a failure becomes RetryAttempt or RequestFailed."""
        try:
            if stall_s is None:
                return await call.read()
            # asyncio.timeout, not wait_for: no extra task per token on the hot path.
            async with asyncio.timeout(stall_s):
                return await call.read()
        except TimeoutError:
            raise self.stalled(worker, stall_s) from None
        except asyncio.CancelledError:
            if client_cancelled():
                raise  # our own task was cancelled (client gone): not a worker failure
            failure = st.failure or RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{worker.role} worker "
                                                  f"{worker.worker_id}: call cancelled (worker dropped)")
            raise failed(failure.code, failure.message, worker) from None
        except grpc.aio.AioRpcError as e:
            if st.failure is not None:
                raise failed(st.failure.code, st.failure.message, worker) from None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.members.drop(worker.worker_id, f"failed mid-request ({e.details()})")
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and st.remaining <= 0:
                raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline exceeded") from None
            transfer = e.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED)
            what = "KV transfer to" if transfer else f"{worker.role} worker"
            raise failed(e.code(), f"{what} {worker.worker_id} failed: {e.details()}", worker) from None

    def stalled(self, worker: WorkerRecord, stall_s: float) -> RetryAttempt:
        """A stream silent for `stall_s`: the worker is hung, so it leaves the pool and the request moves."""
        self.members.drop(worker.worker_id, f"stalled: no token for {stall_s:.1f}s")
        return RetryAttempt(f"{worker.role} worker {worker.worker_id} stalled (no token for {stall_s:.1f}s)",
                            worker.role, worker.worker_id)

    async def call_chunks(self, st: RequestState, lease: Lease):
        """Every token on the Decode call."""
        first = True
        while True:
            # The first message waits for the KV (bounded by the transfer timeout on the worker);
            # after that, a stream silent for the stall timeout is a hung worker.
            msg = await self.read(st, lease.call, lease.worker, None if first else self.stall_s)
            if msg is grpc.aio.EOF:
                raise no_finish(lease.worker)
            first = False
            yield msg.tokens

    async def direct_chunks(self, st: RequestState, lease: Lease, start: int = 0):
        """Tokens from two channels, put back in order: those the worker's engine thread sends,
        and on the call the last, any error, and any the engine thread could not send. `start`:
        the first index (FIRST: a first token prefilled there)."""
        q, stall = lease.tokens, self.stall_s
        pump = asyncio.create_task(self._pump_call(st, lease, q))
        try:
            order, first = InOrder(start), True
            while True:
                async with asyncio.timeout(None if first else stall):
                    item = await q.get()
                first = False
                if isinstance(item, Exception):
                    raise item
                if item is grpc.aio.EOF and order.expected == FIRST:
                    raise no_first(lease.worker)
                if item is grpc.aio.EOF:
                    raise no_finish(lease.worker)
                for tok in order.push(item):
                    yield tok
                    if tok.finish_reason:
                        return
        except TimeoutError:
            raise self.stalled(lease.worker, stall) from None
        finally:
            pump.cancel()

    async def _pump_call(self, st: RequestState, lease: Lease, q: asyncio.Queue) -> None:
        """The call's messages into the queue the engine thread's tokens also reach."""
        try:
            while True:
                msg = await self.read(st, lease.call, lease.worker)
                if msg is not grpc.aio.EOF and msg.HasField("first"):
                    q.put_nowait(first_chunk(msg.first))
                    if msg.first.finish_reason:
                        return
                    continue
                if msg is not grpc.aio.EOF and not msg.tokens.token_ids and not msg.tokens.finish_reason:
                    # The KV's figures, ahead of the first token, which comes on the other
                    # channel: not a chunk of the stream (an empty one would end it).
                    kv_figures(st, msg.tokens)
                    continue
                q.put_nowait(msg.tokens if msg is not grpc.aio.EOF else msg)
                if msg is grpc.aio.EOF or msg.tokens.finish_reason:
                    return
        except (RetryAttempt, RequestFailed) as e:
            q.put_nowait(e)
        except Exception as e:  # never leave the relay waiting for a reader that died
            q.put_nowait(RequestFailed(grpc.StatusCode.INTERNAL, f"decode stream reader failed: {e!r}"))


def kv_figures(st: RequestState, tok) -> None:
    """The KV transfer's time and size, which a decode worker reports with a token."""
    if tok.kv_transfer_bytes:
        st.transfer_s, st.transfer_bytes = tok.kv_transfer_s, tok.kv_transfer_bytes


def no_first(worker: WorkerRecord) -> RetryAttempt:
    """A worker prefilling locally ended its stream before its first token: another may not."""
    return RetryAttempt(f"worker {worker.worker_id} sent no first token", "colocated", worker.worker_id)


def no_finish(worker: WorkerRecord) -> RequestFailed:
    return RequestFailed(grpc.StatusCode.INTERNAL,
                         f"decode worker {worker.worker_id} ended the stream without a finish reason")


def failed(code: grpc.StatusCode, message: str, worker: WorkerRecord) -> Exception:
    """What another attempt may fix is retried; anything else ends the request."""
    if code in _RETRYABLE:
        return RetryAttempt(message, worker.role, worker.worker_id)
    return RequestFailed(code, message)


def first_chunk(ft: wpb.FirstToken) -> TokenChunk:
    """A FirstToken from the call, as the chunk at FIRST the engine thread would have sent."""
    return TokenChunk(FIRST, [ft.token_id], ft.text, [ft.logprob], finish_reason=ft.finish_reason,
                      top_logprobs=(ft.top_logprobs,) if ft.HasField("top_logprobs") else (),
                      prefill_s=ft.prefill_s, cached_tokens=ft.cached_tokens,
                      prompt_logprobs=tuple(ft.prompt_logprobs), prompt_top_logprobs=tuple(ft.prompt_top_logprobs))


def first_token(tok: TokenChunk) -> wpb.FirstToken:
    """The chunk at FIRST as the FirstToken the rest of the request path reads."""
    return wpb.FirstToken(token_id=tok.token_ids[0], logprob=tok.logprobs[0], text=tok.text,
                          top_logprobs=tok.top_logprobs[0] if tok.top_logprobs else None,
                          finish_reason=tok.finish_reason, cached_tokens=tok.cached_tokens, prefill_s=tok.prefill_s,
                          prompt_logprobs=tok.prompt_logprobs, prompt_top_logprobs=tok.prompt_top_logprobs)
