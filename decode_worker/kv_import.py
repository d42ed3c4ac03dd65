"""Checks incoming KV against the reservation and lands frames in the reserved blocks. Until
every check has passed and the sequence is committed, those blocks belong to no running
sequence, so landing a frame early (while later ones are still on the wire) is safe."""

from __future__ import annotations

import warnings

import torch

from engine import KVReservation
from transfer import KVHeader, TransferError, verify


def check_header(header: KVHeader, res: KVReservation, pool: torch.Tensor) -> None:
    """Geometry, block count and hash chain against the reservation."""
    rid = header.request_id
    dtype = str(pool.dtype).removeprefix("torch.")
    if header.dtype != dtype or header.block_shape != list(pool.shape[1:]) or header.block_nbytes != pool[0].nbytes:
        raise TransferError(f"{rid}: blocks of {header.dtype}{header.block_shape} do not fit this pool's "
                            f"{dtype}{list(pool.shape[1:])}")
    missing = res.missing_block_ids
    if header.first_block != res.num_held_blocks or header.num_blocks != len(missing):
        raise TransferError(f"{rid}: {header.num_blocks} blocks from index {header.first_block} shipped, "
                            f"{len(missing)} expected from index {res.num_held_blocks}")
    for i, h in enumerate(header.block_hashes):
        idx = header.first_block + i
        expect = res.block_hashes[idx] if idx < len(res.block_hashes) else None
        if h != expect:
            raise TransferError(f"{rid}: block {idx} hash {h} differs from the prompt's hash chain {expect}")


def land_frame(header: KVHeader, index: int, buf: memoryview, res: KVReservation, pool: torch.Tensor) -> None:
    """Copy one (already checksummed) frame into its reserved blocks."""
    first = sum(f.num_blocks for f in header.frames[:index])
    info = header.frames[index]
    dst = res.missing_block_ids[first:first + info.num_blocks]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only zmq buffers: only read from here
        src = torch.frombuffer(buf, dtype=torch.uint8).view(pool.dtype).view(info.num_blocks, *pool.shape[1:])
    for j, bid in enumerate(dst):
        pool[bid].copy_(src[j])


def check_and_land(header: KVHeader, frames: list[memoryview], res: KVReservation, pool: torch.Tensor) -> None:
    """A whole transfer at once: raise TransferError (nothing used) or land every block."""
    verify(header, frames)
    check_header(header, res, pool)
    for i, buf in enumerate(frames):
        land_frame(header, i, buf, res, pool)
