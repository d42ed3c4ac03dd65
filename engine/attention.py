"""Attention over the paged KV cache for a packed (unpadded) batch.

The runner splits a step into sequences that compute several tokens (prompt chunks,
prefix-hit tails) and sequences that compute one (decode). Multi-token sequences run one
SDPA call each; single-token ones share padded SDPA calls, grouped by context length so a
2048-token sequence does not make every short one in the batch read 2048 padded positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    start: int  # row of the first new token in the packed batch
    num_tokens: int  # new tokens this step
    context_len: int  # tokens in the sequence after this step (cached + new)
    block_table: torch.Tensor  # int64 block ids covering context_len


@dataclass(slots=True)
class DecodeGroup:
    """Single-token sequences of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor  # [B] packed rows
    block_tables: torch.Tensor  # [B, max_blocks], padded with 0
    context_lens: torch.Tensor  # [B]
    max_len: int


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot for each new token
    prefills: list[PrefillSpan]
    decode_groups: list[DecodeGroup]
    block_size: int
    sliding_window: int | None = None


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D] (may be strided
    views). Writes k/v into the cache and returns the attention output [T, H, D]."""
    bs = meta.block_size
    blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v
    out = torch.empty_like(q)
    kvh, d = k.shape[1], k.shape[2]
    for span in meta.prefills:
        s, n, ctx = span.start, span.num_tokens, span.context_len
        # 4-D [1, heads, tokens, dim]: the layout the fused (flash) SDPA kernels take; 3-D falls
        # back to the unfused math path, several times slower on long prompts.
        qs = q[s:s + n].transpose(0, 1)[None]
        if ctx == n and meta.sliding_window is None:
            # Whole sequence computed in this step: no cache read, plain causal attention.
            ks, vs = k[s:s + n].transpose(0, 1)[None], v[s:s + n].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = k_cache[span.block_table].reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]
            vs = v_cache[span.block_table].reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = _window_mask(q_pos, torch.arange(ctx, device=q.device), meta.sliding_window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
    for g in meta.decode_groups:
        b = g.block_tables.shape[0]
        ks = k_cache[g.block_tables].reshape(b, -1, kvh, d)[:, :g.max_len].transpose(1, 2)
        vs = v_cache[g.block_tables].reshape(b, -1, kvh, d)[:, :g.max_len].transpose(1, 2)
        k_pos = torch.arange(g.max_len, device=q.device)
        mask = k_pos[None, :] < g.context_lens[:, None]
        if meta.sliding_window is not None:
            mask &= k_pos[None, :] >= g.context_lens[:, None] - meta.sliding_window
        qd = q[g.rows].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=mask[:, None, None, :], enable_gqa=True)
        out[g.rows] = o.squeeze(2)
    return out
