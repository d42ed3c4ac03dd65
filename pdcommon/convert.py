"""Conversions between the wire (protobuf) and the engine's Python types."""

from __future__ import annotations

from engine.model_meta import KVLayout
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from pdcommon.v1 import router_pb2 as pb
from pdcommon.v1 import worker_pb2 as wpb


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
        presence_penalty=p.presence_penalty if p.HasField("presence_penalty") else 0.0,
        frequency_penalty=p.frequency_penalty if p.HasField("frequency_penalty") else 0.0,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(p.logit_bias),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )


def params_to_proto(s: SamplingParams) -> pb.SamplingParams:
    p = pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos)
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.adjusts_logits:
        p.presence_penalty, p.frequency_penalty = s.presence_penalty, s.frequency_penalty
        p.repetition_penalty = s.repetition_penalty
        p.logit_bias.update(s.logit_bias)
    return p


def top_to_proto(tops: list[dict[int, float] | None]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(logprobs=t or {}) for t in tops]


def stats_to_proto(worker_id: str, role: str, address: str, state: str, st: EngineStats, **extra) -> pb.WorkerStatus:
    return pb.WorkerStatus(worker_id=worker_id, role=role, address=address, state=state, num_running=st.num_running,
                           num_waiting=st.num_waiting, num_blocks=st.num_blocks, used_blocks=st.used_blocks,
                           free_blocks=st.free_blocks, cached_blocks=st.cached_blocks, kv_usage=st.kv_usage,
                           prefix_queries=st.prefix_queries, prefix_hits=st.prefix_hits, engine_steps=st.num_steps,
                           engine_busy_s=st.busy_s, **extra)


def first_token_to_proto(out: RequestOutput, prefill_s: float) -> wpb.FirstToken:
    """The engine's first output of a request (prefill done) as the worker API's FirstToken."""
    top = out.new_top_logprobs[0] if out.new_top_logprobs else None
    return wpb.FirstToken(token_id=out.new_token_ids[0], logprob=out.new_logprobs[0],
                          top_logprobs=pb.TopLogprobs(logprobs=top) if top else None, text=out.text_delta,
                          finish_reason=out.finish_reason or "", cached_tokens=out.num_cached_tokens,
                          prefill_s=prefill_s, prompt_logprobs=out.prompt_logprobs or [],
                          prompt_top_logprobs=top_to_proto(out.prompt_top_logprobs or []))


def tokens_to_proto(outs: list[RequestOutput], **extra) -> wpb.DecodeTokens:
    """One message for consecutive outputs of a request (the last may finish it): a stream that
    fell behind its engine catches up in one message, not one per step."""
    last = outs[-1]
    if len(outs) == 1:
        ids, text, lps, tops = last.new_token_ids, last.text_delta, last.new_logprobs, last.new_top_logprobs
    else:
        ids = [t for o in outs for t in o.new_token_ids]
        lps = [lp for o in outs for lp in o.new_logprobs]
        tops = [tp for o in outs for tp in o.new_top_logprobs]
        text = "".join(o.text_delta for o in outs)
    return wpb.DecodeTokens(token_ids=ids, text=text, logprobs=lps,
                            top_logprobs=top_to_proto(tops) if any(tops) else [],
                            finish_reason=last.finish_reason or "", decode_batch=last.decode_batch, **extra)


def layout_to_proto(layout: KVLayout) -> wpb.KVLayout:
    return wpb.KVLayout(dtype=layout.dtype, block_shape=list(layout.block_shape))


def layout_from_proto(msg: wpb.KVLayout) -> KVLayout:
    return KVLayout(msg.dtype, tuple(msg.block_shape))
