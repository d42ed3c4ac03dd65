"""The engine's KVExport -> a transfer header over its zero-copy frames."""

from __future__ import annotations

from engine import KVExport
from transfer import KVHeader, build_header


def pack_export(exp: KVExport, attempt: int) -> tuple[KVHeader, list[memoryview]]:
    """Checksums are left to the transport, which hashes each frame just before it goes out."""
    meta = {"first_token": exp.first_token, "first_logprob": exp.first_logprob,
            "num_prompt_tokens": len(exp.token_ids), "attempt": attempt}
    header = build_header(exp.request_id, exp.layout.dtype, list(exp.layout.block_shape), exp.layout.block_nbytes,
                          exp.block_hashes, exp.frames, exp.blocks_per_frame, first_block=exp.first_block, meta=meta,
                          checksums=False)
    return header, exp.frames
