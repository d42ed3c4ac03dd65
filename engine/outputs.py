"""What the engine hands back each step and on KV export."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    stop_reason: str | int | None = None
    # Prefill-only request: first token sampled, KV blocks held for export.
    prefilled: bool = False
    new_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)


@dataclass(slots=True)
class KVExport:
    """A prefilled sequence's KV as per-block contiguous buffers (views into the pool)."""

    request_id: str
    token_ids: list[int]  # prompt tokens whose KV the blocks hold
    block_hashes: list[int]  # hash chain of the full blocks
    block_ids: list[int]
    buffers: list[torch.Tensor]  # one contiguous [layers, 2, block_size, kv_heads, head_dim] each
    first_token: int
    first_logprob: float
    skipped_blocks: int = 0  # leading blocks left out because the receiver already holds them


@dataclass(slots=True)
class KVReservation:
    """Blocks an importing engine set aside for one incoming sequence."""

    request_id: str
    block_ids: list[int]  # the whole block table, room to grow included
    num_held_blocks: int  # leading blocks already present (prefix hits), not to be written
    num_prompt_blocks: int  # blocks the prompt's KV fills
    block_hashes: list[int] = field(default_factory=list)

    @property
    def missing_block_ids(self) -> list[int]:
        """The blocks an incoming transfer must fill."""
        return self.block_ids[self.num_held_blocks:self.num_prompt_blocks]


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
