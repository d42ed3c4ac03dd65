"""A request as the scheduler sees it: tokens, progress, and the blocks it owns."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Prefill-only request whose first token is out; its blocks wait to be exported.
    PREFILLED = "prefilled"
    # Imported sequence: blocks reserved, KV still on the wire; counts against max_num_seqs.
    AWAITING_KV = "awaiting_kv"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    prefill_only: bool = False
    # Prefill-only, streaming its KV: (the first block not yet exported, frame size). Each chunk
    # of the prompt exports the full blocks it completed (unless kv_chunks is False); the first
    # token's output the rest.
    kv_stream: tuple[int, int] | None = None
    kv_chunks: bool = True
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # The catch-up rule: the runner computes tokens until num_computed_tokens == len(token_ids).
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # hash chain of full blocks
    num_registered_blocks: int = 0  # leading blocks already published to the prefix cache
    output_logprobs: list[float] = field(default_factory=list)
    # With params.prompt_logprobs: prompt token i's logprob (and top ones) at entry i - 1, filled
    # as the chunks that predict them are computed (a preempted prompt's recompute adds none).
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # Its decode steps (a token sampled after the first) and the sequences sampled in them: the
    # batch it rode, which the planner compares its TPOT with (router/planner/sla.py).
    num_decode_steps: int = 0
    decode_batch_sum: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: its prompt may not come from the
        prefix cache, whose hits skip the rows that predict them."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
