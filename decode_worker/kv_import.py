"""Checks incoming KV against its reservation before anything lands: layout, block count and
the prompt's hash chain. Landing itself is the engine's (LLMEngine.land_kv)."""

from __future__ import annotations

from engine import KVReservation
from transfer import KVHeader, TransferError


def check_header(header: KVHeader, res: KVReservation) -> None:
    rid, layout = header.request_id, res.layout
    if header.dtype != layout.dtype or tuple(header.block_shape) != layout.block_shape \
            or header.block_nbytes != layout.block_nbytes:
        raise TransferError(f"{rid}: blocks of {header.dtype}{header.block_shape} do not fit this pool's "
                            f"{layout.dtype}{list(layout.block_shape)}")
    missing = len(res.missing_block_ids)
    if header.first_block != res.num_held_blocks or header.num_blocks != missing:
        raise TransferError(f"{rid}: {header.num_blocks} blocks from index {header.first_block} shipped, "
                            f"{missing} expected from index {res.num_held_blocks}")
    for i, h in enumerate(header.block_hashes):
        idx = header.first_block + i
        expect = res.block_hashes[idx] if idx < len(res.block_hashes) else None
        if h != expect:
            raise TransferError(f"{rid}: block {idx} hash {h} differs from the prompt's hash chain {expect}")


def frame_offset(header: KVHeader, index: int) -> int:
    """Where frame `index` starts, in blocks from the first shipped block."""
    return sum(f.num_blocks for f in header.frames[:index])
