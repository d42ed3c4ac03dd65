"""Turns a scheduler decision into tensors, runs one packed forward pass, samples.

Only this module builds tensors. The last layer and the logits run only for the rows that sample
(DecoderModel.forward).
"""

from __future__ import annotations

import torch

from engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    native_decode_available,
    native_prefill_available,
)
from engine.kv_cache import KVCache
from engine.model import DecoderModel
from engine.prompt_logprobs import compute, prompt_rows
from engine.sampler import sample
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

_MASK64 = (1 << 63) - 1
# The sequences that sampled, their tokens, logprobs and top logprobs; the prompt logprobs made.
StepResult = tuple[list[Sequence], list[int], list[float], list[dict[int, float] | None],
                   list[tuple[Sequence, list[float], list[dict[int, float]]]]]


def token_seed(seed: int, index: int) -> int:
    """Seed for the index-th output token: sampling depends on (seed, position) only, so a
    request draws the same tokens whether or not it moved between engines or was preempted."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


# Longest tail after cached context that attends through the native decode kernel, one row per
# token. Each row reads its whole context, where the flash kernel shares each K/V load among the
# queries: on the 50M benchmark model (1 thread) tails of 1-4 tokens tie SDPA within 5% after
# 128-1024 cached tokens, 16 tokens lose 17-27% after 512 or more. On a tiny model, whose step is
# all per-op overhead, a 1-token tail prefilled in 2.9 ms against 3.7 (stories260K).
NATIVE_TAIL_MAX_TOKENS = 4


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.sliding_window = model.spec.sliding_window
        spec, k0 = model.spec, kv_cache.layers[0][0]
        # The native kernel reads blocks in place: it needs each token's heads laid out densely.
        self.native_decode = k0.stride(3) == 1 and native_decode_available(
            k0.dtype, k0.device, spec.num_heads, spec.num_kv_heads, spec.head_dim, kv_cache.block_size)
        self.native_prefill = native_prefill_available(k0.dtype, k0.device, spec.head_dim)

    def _metadata(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        # Positions and KV slots as plain ints, made tensors once per step: a decode sequence's
        # are one int each, where building them with torch ops cost ~70 us per sequence (2-3 ms
        # of a 32-sequence step).
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        sample_rows: list[int] = []
        row = 0
        for item in batch.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            ctx = start + n
            ids.extend(seq.token_ids[start:ctx])
            table = seq.block_table[: -(-ctx // bs)]
            positions.extend(range(start, ctx))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, ctx))
            if n == 1 or (self.native_decode and start > 0 and n <= NATIVE_TAIL_MAX_TOKENS):
                # A short tail after cached context (a prefix hit, a resume) attends as n decode
                # rows, token i over the first start + i + 1 positions: causal, read in place by
                # the native kernel, with no gathered copy of the context and no two flash calls
                # to merge (~0.3 ms a layer of fixed cost through SDPA).
                dec_rows.extend(range(row, row + n))
                dec_tables.extend([table] * n)
                dec_lens.extend(range(start + 1, ctx + 1))
            else:
                prefills.append(PrefillSpan(row, n, ctx, torch.tensor(table, dtype=torch.long, device=self.device),
                                            samples=item.samples))
            row += n
            if item.samples:
                sample_rows.append(row - 1)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), prefills=prefills,
                                 decode_groups=self._decode_groups(dec_rows, dec_tables, dec_lens), block_size=bs,
                                 sliding_window=self.sliding_window, native_decode=self.native_decode,
                                 native_prefill=self.native_prefill).prepare(len(ids))
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=dev), meta, sample_rows

    def _decode_groups(self, rows: list[int], tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Bucket decode sequences by context length (a new group once the length doubles), so
        padding costs at most ~2x the real KV read instead of batch x the longest context. The
        native kernel reads no padding: one group, in row order."""
        groups: list[DecodeGroup] = []
        order = list(range(len(rows))) if self.native_decode else sorted(range(len(rows)), key=lambda i: lens[i])
        start = 0
        for j in range(1, len(order) + 1):
            if j < len(order) and (self.native_decode or lens[order[j]] <= 2 * max(lens[order[start]], 64)):
                continue
            idx = order[start:j]
            width = max(len(tables[i]) for i in idx)
            dev = self.device
            groups.append(DecodeGroup(
                rows=torch.tensor([rows[i] for i in idx], dtype=torch.long, device=dev),
                block_tables=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in idx],
                                          dtype=torch.long, device=dev),
                context_lens=torch.tensor([lens[i] for i in idx], dtype=torch.long, device=dev),
                max_len=max(lens[i] for i in idx)))
            start = j
        return groups

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> StepResult:
        """Run the step; return the sequences that sampled, their tokens, logprobs and top
        logprobs, and the prompt logprobs it computed (engine/prompt_logprobs.py)."""
        input_ids, positions, meta, sample_rows = self._metadata(batch)
        wanted = prompt_rows(batch)
        # The last layer computes only the rows that sample (DecoderModel.forward); a step whose
        # every row samples (decode) keeps them all without a gather, and one that owes prompt
        # logprobs computes every row.
        rows = None if len(sample_rows) == len(input_ids) else torch.tensor(sample_rows, dtype=torch.long,
                                                                            device=self.device)
        hidden = self.model(input_ids, positions, self.kv.layers, meta, None if wanted else rows)
        prompt = compute(self.model.compute_logits, hidden, wanted) if wanted else []
        if wanted and rows is not None:
            hidden = hidden[rows]
        sampled = [item.seq for item in batch.scheduled if item.samples]
        if not sampled:
            return [], [], [], [], prompt
        logits = self.model.compute_logits(hidden)
        generators: list[torch.Generator | None] = []
        for seq in sampled:
            if seq.params.greedy:
                generators.append(None)
                continue
            # The engine gives every sampled request a seed (LLMEngine._new_seq).
            g = torch.Generator(device=self.device)
            g.manual_seed(token_seed(seq.params.seed, seq.num_output_tokens))
            generators.append(g)
        history = [(s.token_ids, s.num_prompt_tokens) if s.params.adjusts_logits else None for s in sampled]
        return (sampled, *sample(logits, [s.params for s in sampled], generators, history), prompt)
