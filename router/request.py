"""A request as the router tracks it, and the two ways an attempt at it can end badly."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from engine import SamplingParams
from pdcommon.convert import params_to_proto
from pdcommon.v1 import router_pb2 as pb


class RequestFailed(Exception):
    """Ends the request with this status for the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class RetryAttempt(Exception):
    """This attempt failed in a way another attempt may not (a transfer lost or rejected, a
    worker gone or stalled). `role`/`worker` name the worker the next attempt avoids."""

    def __init__(self, message: str, role: str = "", worker: str = "") -> None:
        super().__init__(message)
        self.message, self.role, self.worker = message, role, worker


def client_cancelled() -> bool:
    """True when the current task itself is being cancelled (the client left or cancelled).

    A CancelledError can also surface from a worker call that gRPC cancelled underneath us (its
    channel closed when the worker was dropped); that is a worker failure, and treating it as the
    client's cancel would end the request without ever answering the client."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    deadline: float
    arrival: float
    slo: pb.SloTargets | None = None
    prefix: list[int] = field(default_factory=list)  # leading block hashes, for prefix-aware routing
    failure: RequestFailed | None = None  # set by whoever fails the request from outside (membership)
    calls: list = field(default_factory=list)  # this attempt's open worker calls, cancelled on failure
    attempt: int = 0
    avoid: set[str] = field(default_factory=set)  # workers that failed an earlier attempt
    first_failure: float | None = None
    sent_ids: list[int] = field(default_factory=list)  # every token the client has: a retry resumes after them
    prefill_rec: object | None = None  # the prefill worker whose KV this attempt still waits for
    first_sent: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_batch: float = 0.0  # the mean batch of its decode steps, as its decode worker counted
    transfer_bytes: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""

    def sampling(self) -> pb.SamplingParams:
        """The params a worker gets for this attempt: a resumed one (failover) owes no prompt
        logprobs, which the first attempt delivered, and would count its resumed tokens in them."""
        p = params_to_proto(self.params)
        if self.sent_ids:
            p.ClearField("prompt_logprobs")
        return p

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Fail from outside the request's own task: record why, then cancel its worker calls
        so the task wakes up and raises this failure."""
        if self.failure is None:
            self.failure = RequestFailed(code, message)
        for call in self.calls:
            call.cancel()

    @property
    def worker_request_id(self) -> str:
        """The id workers know this attempt by: a retry never meets the previous attempt's
        leftovers (still being cleaned up) on the same worker."""
        return f"{self.request_id}@{self.attempt}"

    @property
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def blocks_needed_tokens(self) -> int:
        return len(self.prompt) + self.params.max_tokens
