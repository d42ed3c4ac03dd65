"""Engine KVExport -> transfer header + zero-copy frames (one per run of consecutive blocks)."""

from __future__ import annotations

import torch

from engine import KVExport
from transfer import KVHeader, build_header, frame_runs


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous tensor, without copying on CPU (any dtype, bf16 too)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pack_export(exp: KVExport, pool: torch.Tensor, max_frame_bytes: int) -> tuple[KVHeader, list[memoryview]]:
    """`pool` is the engine's block-major KV tensor; runs of consecutive block ids are contiguous there."""
    block_nbytes = pool[0].nbytes
    per_frame = max(1, max_frame_bytes // block_nbytes)
    frames, counts = [], []
    for start, count in frame_runs(exp.block_ids, per_frame):
        frames.append(tensor_bytes(pool[start:start + count]))
        counts.append(count)
    first = exp.skipped_blocks
    shipped = range(first, first + len(exp.block_ids))
    hashes = [exp.block_hashes[i] if i < len(exp.block_hashes) else None for i in shipped]
    meta = {"first_token": exp.first_token, "first_logprob": exp.first_logprob, "num_prompt_tokens": len(exp.token_ids)}
    header = build_header(exp.request_id, str(pool.dtype).removeprefix("torch."), list(pool.shape[1:]), block_nbytes,
                          hashes, frames, counts, first_block=first, meta=meta, checksums=False)
    return header, frames
