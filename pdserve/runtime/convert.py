"""Conversions between the wire (protobuf) and the engine's Python types."""

from __future__ import annotations

from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from pdserve.v1 import router_pb2 as pb


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises engine.InvalidRequestError for out-of-range values."""
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else 16,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
    )


def params_to_proto(s: SamplingParams) -> pb.SamplingParams:
    p = pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos)
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    return p


def top_to_proto(tops: list[dict[int, float] | None]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(logprobs=t or {}) for t in tops]


def stats_to_proto(worker_id: str, role: str, address: str, state: str, st: EngineStats, **extra) -> pb.WorkerStatus:
    return pb.WorkerStatus(worker_id=worker_id, role=role, address=address, state=state, num_running=st.num_running,
                           num_waiting=st.num_waiting, num_blocks=st.num_blocks, used_blocks=st.used_blocks,
                           free_blocks=st.free_blocks, cached_blocks=st.cached_blocks, kv_usage=st.kv_usage,
                           prefix_queries=st.prefix_queries, prefix_hits=st.prefix_hits, **extra)
