"""Token sampling: greedy, temperature, top-k, top-p, penalties, per-request generators.

Each random row draws with its own request's torch.Generator, so a seeded request
gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from engine.kernels import elementwise as native_elementwise
from engine.kernels import sample_rows
from engine.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def argmax_lse(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first largest logit's index and the log-sum-exp. A token's logprob is its
    logit less the row's log-sum-exp, so no whole log-softmax is written: one native pass where
    it can (engine/csrc/elementwise.c; 32 rows of a 32000-token vocabulary 1.9-2.7 -> 0.5 ms)."""
    fns = native_elementwise() if logits.dtype == torch.float32 and logits.device.type == "cpu" else None
    if fns is None or logits.dim() != 2 or logits.stride(1) != 1:
        return torch.argmax(logits, dim=-1), torch.logsumexp(logits, dim=-1)
    rows, cols = logits.shape
    tokens, lse = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float32)
    fns.row_argmax_lse(logits.data_ptr(), logits.stride(0), rows, cols, tokens.data_ptr(), lse.data_ptr())
    return tokens, lse


def adjust(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt: int) -> None:
    """A row of logits [V], in place, with the request's penalties (SamplingParams) on what it has
    seen (repetition on the prompt's and the output's tokens, presence and frequency on the
    output's), then its logit bias."""
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    out = token_ids[num_prompt:]
    if out and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(out, dtype=torch.long, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           history: list[tuple[list[int], int] | None] | None = None,
           ) -> tuple[list[int], list[float], list[dict[int, float] | None]]:
    """logits: [B, V] float32; history: for each row whose logits are adjusted (penalties, a bias;
    None for the others), its tokens so far and how many are its prompt. Returns the sampled ids,
    their logprobs under the raw model distribution (before penalties, temperature and filtering,
    as vLLM reports them) and, for rows that ask, the top-n alternatives."""
    tokens, lse = argmax_lse(logits)
    pen = [i for i, h in enumerate(history or ()) if h is not None]
    choose = logits
    if pen:  # chosen from adjusted logits, reported under the raw ones
        choose = logits.clone()
        for i in pen:
            adjust(choose[i], params[i], *history[i])
            if params[i].greedy:
                tokens[i] = torch.argmax(choose[i])
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        tokens[rows] = _draw(choose, rows, params, generators)
    chosen = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    top: list[dict[int, float] | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.logprobs:
            vals, idx = torch.topk(logits[i], p.logprobs)
            top[i] = dict(zip(idx.tolist(), (vals - lse[i]).tolist(), strict=True))
    return tokens.tolist(), chosen.tolist(), top


def _draw(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
          generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token for each of `rows`, by inverse CDF: each row draws one uniform from its own
    generator, so a seeded request draws the same whatever shares its batch."""
    u = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64, device=logits.device)
                   for i in rows])
    return draw_rows(logits, rows, [params[i].temperature for i in rows], [params[i].top_k for i in rows],
                     [params[i].top_p for i in rows], u)


def draw_rows(logits: torch.Tensor, rows: list[int], temperatures: list[float], top_k: list[int],
              top_p: list[float], u: torch.Tensor) -> torch.Tensor:
    """For each of `rows` of logits [B, V]: the token at u[j] (float64 in [0, 1)) of the row's
    distribution after temperature, top-k and then top-p, its tokens in vocabulary order. One
    native call for all rows where it can (engine/csrc/sampling.c: no sort, a few passes a row),
    else torch ops."""
    fn = sample_rows() if logits.dtype == torch.float32 and logits.device.type == "cpu" else None
    if fn is None or logits.dim() != 2 or logits.stride(1) != 1:
        return _draw_torch(logits, rows, temperatures, top_k, top_p, u)
    n, vocab = len(rows), logits.shape[1]
    index = torch.tensor(rows, dtype=torch.int64)
    temps = torch.tensor(temperatures, dtype=torch.float32)
    ks = torch.tensor(top_k, dtype=torch.int64)
    ps = torch.tensor(top_p, dtype=torch.float32)
    u = u.to(torch.float64).contiguous()
    scratch = torch.empty(n, 2 * vocab, dtype=torch.float32)
    out = torch.empty(n, dtype=torch.int64)
    fn(logits.data_ptr(), logits.stride(0), index.data_ptr(), n, vocab, temps.data_ptr(), ks.data_ptr(),
       ps.data_ptr(), u.data_ptr(), scratch.data_ptr(), out.data_ptr())
    return out


def _draw_torch(logits: torch.Tensor, rows: list[int], temperatures: list[float], top_k: list[int],
                top_p: list[float], u: torch.Tensor) -> torch.Tensor:
    """draw_rows with torch ops: a sort per top-p row (~1.8 ms for 32000 tokens), and softmax,
    cumulative sum and search over all rows at once."""
    vocab = logits.shape[-1]
    temps = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
    scaled = logits[rows].div_(temps[:, None])  # logits[rows] is a copy: divided in place
    hot = torch.isposinf(scaled).any(dim=1)  # a temperature so small that logits overflowed: the
    if bool(hot.any()):  # limit, all of the row's probability on its largest logit (the first, as the kernel)
        idx = torch.tensor(rows, device=logits.device)[hot]
        point = torch.full_like(scaled[hot], float("-inf"))
        scaled[hot] = point.scatter_(1, logits[idx].argmax(dim=1, keepdim=True), 0.0)
    for j in range(len(rows)):
        row = scaled[j]
        filtered = _filter_top_k_top_p(row, top_k[j], top_p[j])
        if filtered is not row:  # the filter returns its input when neither top-k nor top-p applies
            scaled[j] = filtered
    # float64 sums: a float32 running sum over 32000 entries drifts by ~1e-4, as much as many
    # tokens' whole probability.
    cdf = torch.softmax(scaled, dim=-1).double().cumsum(dim=-1)
    target = (u.to(cdf.device, torch.float64) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # The first token whose running sum passes the target. u * total can round up to the total,
    # and the search then runs past the last token with any probability (rare): such a row takes
    # that last token, the first index whose sum is the total.
    past = (cdf.gather(1, picked) <= target).squeeze(1)
    picked = picked.squeeze(1)
    if bool(past.any()):
        picked[past] = cdf[past].argmax(dim=-1)
    return picked
