"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's echo with logprobs): the log-probability
of each prompt token after the ones before it, from the rows of a prefill step that sample
nothing. The runner calls this; a step that needs it runs the last layer over every row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

# Rows whose logits are made at once: a 2048-token chunk's full logits over a 32k vocabulary
# would be 256 MiB; this many rows keeps it to a few MiB.
ROWS_PER_SLICE = 128


@dataclass(slots=True)
class PromptRows:
    seq: Sequence
    rows: list[int]  # the step's rows (hidden-state indices) whose logits predict ...
    targets: list[int]  # ... these prompt tokens


def prompt_rows(batch: SchedulerOutput) -> list[PromptRows]:
    """Per sequence still owed prompt logprobs: the rows of this step that predict prompt tokens
    it has no logprob for yet (position p predicts token p + 1; the first token has none)."""
    out, row = [], 0
    for item in batch.scheduled:
        seq, n = item.seq, item.num_new_tokens
        if seq.needs_prompt_logprobs:
            start = seq.num_computed_tokens
            first = max(start, len(seq.prompt_logprobs))  # entry i - 1 is token i's: positions before this have one
            last = min(start + n, seq.num_prompt_tokens - 1)
            if first < last:
                out.append(PromptRows(seq, [row + p - start for p in range(first, last)],
                                      seq.token_ids[first + 1:last + 1]))
        row += n
    return out


def compute(logits_of, hidden: torch.Tensor, wanted: list[PromptRows]
            ) -> list[tuple[Sequence, list[float], list[dict[int, float]]]]:
    """Each sequence's new prompt logprobs and top ones, under the raw model distribution (as
    the sampled tokens' logprobs are): `logits_of` maps hidden rows to logits."""
    got = []
    for w in wanted:
        k = w.seq.params.prompt_logprobs or 0
        lps: list[float] = []
        tops: list[dict[int, float]] = []
        for s in range(0, len(w.rows), ROWS_PER_SLICE):
            rows = torch.tensor(w.rows[s:s + ROWS_PER_SLICE], dtype=torch.long, device=hidden.device)
            targets = torch.tensor(w.targets[s:s + ROWS_PER_SLICE], dtype=torch.long, device=hidden.device)
            logp = torch.log_softmax(logits_of(hidden[rows]), dim=-1)
            lps += logp.gather(1, targets[:, None])[:, 0].tolist()
            if k:
                vals, ids = logp.topk(k, dim=-1)
                tops += [dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
            else:
                tops += [{} for _ in range(rows.shape[0])]
        got.append((w.seq, lps, tops))
    return got
