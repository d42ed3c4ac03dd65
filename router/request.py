"""A request as the router tracks it, and the two ways an attempt at it can end badly."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from engine import SamplingParams
from pdcommon.v1 import router_pb2 as pb


class RequestFailed(Exception):
    """Ends the request with this status for the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class RetryAttempt(Exception):
    """This attempt failed in a way another attempt may not (a transfer lost or rejected, a
    worker gone before any decode token was relayed). `avoid` names the decode worker to skip."""

    def __init__(self, message: str, avoid: str = "") -> None:
        super().__init__(message)
        self.message, self.avoid = message, avoid


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
    avoid: set[str] = field(default_factory=set)  # decode workers that failed an earlier attempt
    first_sent: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    relayed: int = 0  # decode-stream messages relayed to the client (after the first token)
    cached_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Fail from outside the request's own task: record why, then cancel its worker calls
        so the task wakes up and raises this failure."""
        if self.failure is None:
            self.failure = RequestFailed(code, message)
        for call in self.calls:
            call.cancel()

    @property
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def blocks_needed_tokens(self) -> int:
        return len(self.prompt) + self.params.max_tokens
