"""Checks incoming KV against its reservation before anything lands: layout, block range and
the prompt's hash chain. Landing itself is the engine's (LLMEngine.land_kv).

A KV may come in parts (a prompt computed in chunks ships each chunk's blocks as it finishes,
prefill_worker/service.py): each part is a transfer of its own, covering blocks no other part
covered, and the one that carries the first token ends at the last block."""

from __future__ import annotations

from engine import KVReservation
from transfer import KVHeader, TransferError


def check_header(header: KVHeader, res: KVReservation, claimed: bytearray | None = None) -> None:
    """Raise TransferError unless the transfer fits the reservation. `claimed` (one byte per
    missing block) marks the blocks earlier parts took; this part's are marked when it fits."""
    rid, layout = header.request_id, res.layout
    if header.dtype != layout.dtype or tuple(header.block_shape) != layout.block_shape \
            or header.block_nbytes != layout.block_nbytes:
        raise TransferError(f"{rid}: blocks of {header.dtype}{header.block_shape} do not fit this pool's "
                            f"{layout.dtype}{list(layout.block_shape)}")
    missing = len(res.missing_block_ids)
    lo = header.first_block - res.num_held_blocks
    hi = lo + header.num_blocks
    whole = claimed is None or "first_token" in header.meta  # the whole KV, or the part that ends it
    if lo < 0 or hi > missing or (whole and hi != missing) or (not whole and header.num_blocks == 0) \
            or (claimed is None and lo != 0):
        raise TransferError(f"{rid}: {header.num_blocks} blocks from index {header.first_block} shipped, "
                            f"{missing} expected from index {res.num_held_blocks}")
    if claimed is not None and any(claimed[lo:hi]):
        raise TransferError(f"{rid}: blocks {header.first_block}..{header.first_block + header.num_blocks - 1} "
                            "were shipped already")
    for i, h in enumerate(header.block_hashes):
        idx = header.first_block + i
        expect = res.block_hashes[idx] if idx < len(res.block_hashes) else None
        if h != expect:
            raise TransferError(f"{rid}: block {idx} hash {h} differs from the prompt's hash chain {expect}")
    if claimed is not None:
        claimed[lo:hi] = b"\x01" * (hi - lo)


def frame_offset(header: KVHeader, index: int) -> int:
    """Where frame `index` starts, in blocks from the first shipped block."""
    return sum(f.num_blocks for f in header.frames[:index])
