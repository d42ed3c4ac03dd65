"""The engine's KVExport -> a transfer header over its zero-copy frames."""

from __future__ import annotations

from collections.abc import Sequence

from engine import KVExport
from transfer import KVHeader, build_header


def merge_exports(parts: Sequence[KVExport]) -> KVExport:
    """Consecutive exports of one request as one transfer: the first's start, the last's prompt
    and first token (a part held back while too small to ship alone, then the rest)."""
    first, last = parts[0], parts[-1]
    if len(parts) == 1:
        return first
    for a, b in zip(parts, parts[1:], strict=False):
        if a.first_block + a.num_blocks != b.first_block:
            raise ValueError(f"{first.request_id}: exports at blocks {a.first_block} (+{a.num_blocks}) and "
                             f"{b.first_block} are not consecutive")
    return KVExport(last.request_id, last.token_ids, last.layout, first.first_block,
                    [h for p in parts for h in p.block_hashes], [f for p in parts for f in p.frames],
                    [n for p in parts for n in p.blocks_per_frame], last.first_token, last.first_logprob)


def pack_export(exp: KVExport, attempt: int) -> tuple[KVHeader, list[memoryview]]:
    """Checksums are left to the transport, which hashes each frame just before it goes out.
    A part shipped while the prompt is still being computed has no first token in its meta: the
    receiver starts the sequence on the transfer that has one, once every part has landed."""
    meta = {"num_prompt_tokens": len(exp.token_ids), "attempt": attempt}
    if exp.first_token >= 0:
        meta.update(first_token=exp.first_token, first_logprob=exp.first_logprob)
    header = build_header(exp.request_id, exp.layout.dtype, list(exp.layout.block_shape), exp.layout.block_nbytes,
                          exp.block_hashes, exp.frames, exp.blocks_per_frame, first_block=exp.first_block, meta=meta,
                          checksums=False)
    return header, exp.frames
