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
    mask: torch.Tensor | None = None  # cached-context spans under a window: [n, ctx] mask, by prepare()
    samples: bool = True  # its last row samples a token (a prompt's last chunk); an earlier chunk's does not


@dataclass(slots=True)
class DecodeGroup:
    """Single-token sequences of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor  # [B] packed rows
    block_tables: torch.Tensor  # [B, max_blocks], padded with 0
    context_lens: torch.Tensor  # [B]
    max_len: int
    mask: torch.Tensor | None = None  # [B, 1, 1, max_len]; built once per step by prepare()
    all_rows: bool = False  # rows are exactly 0..T-1 in order: no gather/scatter needed


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot for each new token
    prefills: list[PrefillSpan]
    decode_groups: list[DecodeGroup]
    block_size: int
    sliding_window: int | None = None
    # Where each new token's K/V goes: block and offset, computed once per step (not per layer).
    slot_blocks: torch.Tensor | None = None
    slot_offsets: torch.Tensor | None = None
    # Decode attention by the native kernel (engine/kernels.py): the runner sets it where
    # native_decode_available() says so for the cache's dtype and shape.
    native_decode: bool = False
    # Whole-prompt causal attention by the native kernel (native_prefill_available).
    native_prefill: bool = False

    def prepare(self, num_tokens: int) -> AttentionMetadata:
        """Everything every layer would otherwise recompute: slot split, masks, row layout."""
        bs, dev = self.block_size, self.slot_mapping.device
        self.slot_blocks, self.slot_offsets = self.slot_mapping // bs, self.slot_mapping % bs
        for span in self.prefills:
            # A chunk after cached context needs a mask only under a sliding window (or off CPU);
            # otherwise paged_attention splits it into the unmasked prefix and the causal chunk.
            if self.sliding_window is not None or (span.context_len != span.num_tokens and dev.type != "cpu"):
                ctx, n = span.context_len, span.num_tokens
                span.mask = _window_mask(torch.arange(ctx - n, ctx, device=dev), torch.arange(ctx, device=dev),
                                         self.sliding_window)
        for g in self.decode_groups:
            if self.native_decode:
                continue  # the native kernel reads context_lens itself: no mask to build
            k_pos = torch.arange(g.max_len, device=dev)
            mask = k_pos[None, :] < g.context_lens[:, None]
            if self.sliding_window is not None:
                mask &= k_pos[None, :] >= g.context_lens[:, None] - self.sliding_window
            g.mask = mask[:, None, None, :]
        if not self.prefills and len(self.decode_groups) == 1:
            g = self.decode_groups[0]
            g.all_rows = g.rows.shape[0] == num_tokens and bool((g.rows == torch.arange(num_tokens, device=dev)).all())
        return self


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache[table] for a per-layer pool view whose blocks are each contiguous: index_select over
    whole blocks copies them as rows, ~2.5x faster than advanced indexing, which copies elementwise."""
    rows = torch.index_select(cache.flatten(1), 0, table.reshape(-1))
    return rows.view(*table.shape, *cache.shape[1:])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """k_cache[blocks, offsets] = k and the same for v: natively in one call where each token's
    heads lie packed in k, v and the caches' slots (a CPU pool), else by index_put."""
    from engine.kernels import elementwise

    fns = elementwise() if k.device.type == "cpu" and k_cache.device.type == "cpu" else None
    if (fns is not None and rows_packed(k) and rows_packed(v) and rows_packed(k_cache)
            and k_cache.stride() == v_cache.stride() and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and blocks.dtype == offsets.dtype == torch.int64 and blocks.is_contiguous() and offsets.is_contiguous()):
        e = k.element_size()
        fns.write_kv(k.data_ptr(), k.stride(0) * e, v.data_ptr(), v.stride(0) * e, k.shape[0],
                     k.shape[1] * k.shape[2] * e, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0) * e,
                     k_cache.stride(1) * e, blocks.data_ptr(), offsets.data_ptr())
        return
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    sampled_only: bool = False) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D] (may be strided
    views). Writes k/v into the cache and returns the attention output [T, H, D]. `sampled_only`
    (the last layer, whose output only the sampling rows read): a prompt span that does not
    sample is skipped, and the native kernel computes only the last row of one that does; the
    rows not computed are left unset."""
    if meta.slot_blocks is None:
        meta.prepare(q.shape[0])
    write_kv(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
    kvh, d = k.shape[1], k.shape[2]
    if not meta.prefills and len(meta.decode_groups) == 1 and meta.decode_groups[0].all_rows:
        return _decode(q, k_cache, v_cache, meta.decode_groups[0], kvh, d, meta)  # a pure decode step
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: the native kernel writes its rows
    for span in meta.prefills:
        if sampled_only and not span.samples:
            continue  # an earlier chunk of a prompt: its K and V are all the last layer needs of it
        s, n, ctx = span.start, span.num_tokens, span.context_len
        if meta.native_prefill and meta.sliding_window is None:
            if ctx == n:
                ks, vs = k[s:s + n], v[s:s + n]
            else:  # a chunk after cached context (chunked prefill, a prefix hit)
                ks = gather_blocks(k_cache, span.block_table).reshape(-1, kvh, d)[:ctx]
                vs = gather_blocks(v_cache, span.block_table).reshape(-1, kvh, d)[:ctx]
            # In the last layer, the span's last row alone: one query after ctx - 1 keys.
            first = s + n - 1 if sampled_only else s
            _native_prefill(q[first:s + n], ks, vs, ctx - (s + n - first), out[first:s + n])
            continue
        # 4-D [1, heads, tokens, dim]: the layout the fused (flash) SDPA kernels take; 3-D falls
        # back to the unfused math path, several times slower on long prompts.
        qs = q[s:s + n].transpose(0, 1)[None]
        if ctx == n and meta.sliding_window is None:
            # Whole sequence computed in this step: no cache read, plain causal attention.
            ks, vs = k[s:s + n].transpose(0, 1)[None], v[s:s + n].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = gather_blocks(k_cache, span.block_table).reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]
            vs = gather_blocks(v_cache, span.block_table).reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]
            if span.mask is None:
                o = _prefix_then_causal(qs, ks, vs, ctx - n)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
    for g in meta.decode_groups:
        out[g.rows] = _decode(q[g.rows], k_cache, v_cache, g, kvh, d, meta)
    return out


def _prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """Attention of a chunk q [1, H, n, D] over `prefix` cached tokens plus itself (k, v: [1, KVH,
    prefix + n, D]) as two flash calls merged by their log-sum-exps: the prefix needs no mask and
    the chunk is plain causal, so no masked rectangle is computed (~1.3-1.8x faster than one call
    with an explicit mask, which also gives up the causal block skipping)."""
    _, h, n, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    # Query heads of one KV head are consecutive: grouped, they share its K/V with no copy.
    o1, l1 = _flash(q.reshape(1, kvh, g * n, d), k[:, :, :prefix], v[:, :, :prefix])
    o1, l1 = o1.reshape(1, h, n, d), l1.reshape(1, h, n)
    kc, vc = k[:, :, prefix:], v[:, :, prefix:]
    if g > 1:
        kc, vc = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)
    o2, l2 = _flash(q, kc, vc, is_causal=True)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_(), (l2 - m).exp_()
    total = w1 + w2
    return (o1 * (w1 / total)[..., None]).add_(o2 * (w2 / total)[..., None])


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel behind F.scaled_dot_product_attention, which alone returns the
    log-sum-exp needed to merge partial attentions."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal)[:2]


def native_decode_available(dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int,
                            head_dim: int, block_size: int) -> bool:
    """Whether decode attention can run in the native paged kernel: fp32 on the CPU, within its
    limits, and a C compiler that built it."""
    if dtype != torch.float32 or device.type != "cpu":
        return False
    from engine.kernels import paged_decode

    fn = paged_decode()
    if fn is None:
        return False
    max_h, max_d, max_bs = fn.limits
    return num_heads <= max_h and head_dim <= max_d and block_size <= max_bs


def native_prefill_available(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether whole-prompt attention can run in the native kernel: fp32 on the CPU, a head size
    its vectors divide, and a C compiler that built it."""
    if dtype != torch.float32 or device.type != "cpu":
        return False
    from engine.kernels import prefill_attention

    fn = prefill_attention()
    return fn is not None and head_dim % fn.vector_width == 0 and head_dim <= fn.max_dim


def _native_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of n new tokens after `prefix` cached ones (engine/csrc/prefill_attention.c);
    q: [n, H, D], k, v: [prefix + n, KVH, D], each with its heads packed in a row but rows at any
    stride (views into the fused QKV projection are read in place); the result goes to `out`
    ([n, H, D], contiguous) when given. 1.2-2x faster than torch's flash SDPA at 512-2048 tokens
    of a 64-wide head, whose small inner GEMMs run far below the library's large-GEMM rate; after
    a prefix it is one call, not two flash calls and a merge."""
    from engine.kernels import prefill_attention

    n, h, d = q.shape
    if not rows_packed(q):
        q = q.contiguous()
    if not (rows_packed(k) and rows_packed(v) and k.stride(0) == v.stride(0)):
        k, v = k.contiguous(), v.contiguous()
    if out is None:
        out = torch.empty(n, h, d, dtype=q.dtype)
    elif not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"prompt attention writes a contiguous {tuple(q.shape)} {q.dtype} output")
    if prefill_attention()(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), n, prefix, h,
                           k.shape[1], d, d ** -0.5, out.data_ptr()) != 0:
        raise MemoryError(f"prompt attention: no memory for the transposed keys of {n} tokens")
    return out


def rows_packed(x: torch.Tensor) -> bool:
    """Whether each token's heads lie packed in one row (the last two dims, [..., H, D], with unit
    stride in D and D between heads: [T, H, D] activations, or a pool's [blocks, slots, H, D]);
    the strides before them may be anything."""
    return x.stride(-1) == 1 and (x.shape[-2] == 1 or x.stride(-2) == x.shape[-1])


def _native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                   window: int | None) -> torch.Tensor:
    """Decode attention read in place from the paged pool (engine/csrc/paged_attention.c): no
    gathered copy of the context, no padding. ~4-7x faster than gather + SDPA at 8-64 sequences
    of 512 tokens. ctypes releases the GIL for the call."""
    from engine.kernels import paged_decode

    if not rows_packed(q):
        q = q.contiguous()
    b, h, d = q.shape
    out = torch.empty(b, h, d, dtype=q.dtype)
    tables, lens = g.block_tables, g.context_lens
    # q's rows are read where they lie (a view of the qkv projection), each `q.stride(0)` apart.
    paged_decode()(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                   k_cache.stride(1), k_cache.stride(2), tables.data_ptr(), tables.stride(0), lens.data_ptr(), b, h,
                   k_cache.shape[2], d, k_cache.shape[1], window or 0, d ** -0.5, out.data_ptr())
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup, kvh: int,
            d: int, meta: AttentionMetadata) -> torch.Tensor:
    """Attention for a group of single-token sequences; q: [B, H, D]. Natively where it can,
    else one padded SDPA call."""
    if meta.native_decode:  # set only for CPU fp32 pools (native_decode_available)
        return _native_decode(q, k_cache, v_cache, g, meta.sliding_window)
    b = g.block_tables.shape[0]
    ks = gather_blocks(k_cache, g.block_tables).reshape(b, -1, kvh, d)[:, :g.max_len].transpose(1, 2)
    vs = gather_blocks(v_cache, g.block_tables).reshape(b, -1, kvh, d)[:, :g.max_len].transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=g.mask, enable_gqa=True)  # [B, H, 1, D]
    return o.squeeze(2)
