"""What the engine hands back each step and on KV export."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.model_meta import KVLayout


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
    # On the output that carries a sequence's first sampled token: seconds from its first
    # scheduling to that token (0 otherwise), so a server needs no second call to learn it.
    prefill_s: float = 0.0
    # On the first token's output, with params.prompt_logprobs: prompt token i's logprob and
    # top logprobs at entry i - 1 (the first prompt token has none). None otherwise.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    # On a finishing output: the mean number of sequences in its decode steps (0: it had none).
    decode_batch: float = 0.0
    # A request streaming its KV (LLMEngine.add_request's stream_kv_from): what this step made
    # ready to ship. A chunk's output (no tokens) carries the blocks it completed, as copies; the
    # first token's output carries the rest, zero-copy, valid until `release`.
    kv_part: KVExport | None = None


@dataclass(slots=True)
class KVExport:
    """A prefilled sequence's KV, ready to ship: zero-copy byte frames over its pool blocks
    (valid until the engine releases the request) and what the receiver needs to check them."""

    request_id: str
    token_ids: list[int]  # prompt tokens whose KV the blocks hold
    layout: KVLayout
    first_block: int  # index in the block table of the first shipped block (the receiver holds those before)
    block_hashes: list[int | None]  # one per shipped block; None for a trailing partial block
    frames: list[memoryview]
    blocks_per_frame: list[int]
    first_token: int  # -1 in a part exported while the prompt is still being computed
    first_logprob: float

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True, eq=False)
class KVReservation:
    """Blocks an importing engine set aside for one incoming sequence. While `open`, frames may
    land in its missing blocks from any thread (LLMEngine.land_kv); commit and abort close it
    under `lock` before the blocks change hands."""

    request_id: str
    layout: KVLayout
    block_ids: list[int]  # the whole block table, room to grow included
    num_held_blocks: int  # leading blocks already present (prefix hits), not to be written
    num_prompt_blocks: int  # blocks the prompt's KV fills
    block_hashes: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    open: bool = True

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
    num_steps: int = 0  # steps that ran the model
    busy_s: float = 0.0  # their seconds, schedule to outputs
