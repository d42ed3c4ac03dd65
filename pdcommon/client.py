"""A small synchronous client for the router's gRPC API (used by the CLI, the demo and tests)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdcommon.security import ClusterIdentity
from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import router_pb2_grpc as rrpc
from pdcommon.v1 import worker_pb2_grpc as wrpc


@dataclass(slots=True)
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    prefill_worker: str = ""
    decode_worker: str = ""
    client_ttft: float = 0.0
    chunks: int = 0


def fields(msg) -> dict:
    """A flat message as a plain dict (every field, zeros included, integers kept as int)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def make_request(prompt: str | list[int], max_tokens: int = 16, temperature: float = 0.0, seed: int | None = None,
                 top_p: float | None = None, top_k: int | None = None, stop: list[str] | None = None,
                 request_id: str = "", ignore_eos: bool = False, logprobs: int | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 repetition_penalty: float | None = None, logit_bias: dict[int, float] | None = None,
                 prompt_logprobs: int | None = None) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop or [], ignore_eos=ignore_eos)
    for name, value in (("seed", seed), ("top_p", top_p), ("top_k", top_k), ("logprobs", logprobs),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(sp, name, value)
    sp.logit_bias.update(logit_bias or {})
    req = pb.GenerateRequest(sampling=sp, request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def auth_metadata(api_key: str | None = None) -> tuple[tuple[str, str], ...] | None:
    """The public API's key as gRPC metadata: the one given, else PDSERVE_API_KEY, else none."""
    key = api_key or os.environ.get("PDSERVE_API_KEY")
    return (("authorization", f"Bearer {key}"),) if key else None


class RouterClient:
    def __init__(self, address: str, api_key: str | None = None) -> None:
        self.address = address.removeprefix("grpc://")
        self.channel = grpc.insecure_channel(self.address)
        self.stub = rrpc.RouterStub(self.channel)
        self.metadata = auth_metadata(api_key)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Completion:
        out = Completion()
        t0 = time.perf_counter()
        for msg in self.stream(request, timeout):
            if not out.chunks:
                out.client_ttft = time.perf_counter() - t0
            out.chunks += 1
            out.request_id = msg.request_id
            out.token_ids += msg.token_ids
            out.text += msg.text
            out.logprobs += msg.logprobs
            if msg.finish_reason:
                out.finish_reason = msg.finish_reason
                out.usage, out.timings = fields(msg.usage), fields(msg.timings)
                out.prefill_worker, out.decode_worker = msg.prefill_worker, msg.decode_worker
        return out

    def status(self) -> pb.ClusterStatusResponse:
        return self.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=self.metadata)

    def health(self) -> pb.HealthResponse:
        return self.stub.Health(pb.HealthRequest(), timeout=10, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ControlClient:
    """Operator calls on the router's internal control plane (cluster credentials required)."""

    def __init__(self, address: str, identity: ClusterIdentity) -> None:
        self.identity = identity
        self.channel = identity.channel(address)
        self.stub = wrpc.ControlStub(self.channel)

    def scale(self, pool: str, replicas: int, timeout: float = 120) -> pb.ScaleResponse:
        return self.stub.Scale(pb.ScaleRequest(pool=pool, replicas=replicas), timeout=timeout,
                               metadata=self.identity.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
