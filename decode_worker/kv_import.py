"""Checks an incoming KV transfer against the reservation and lands its frames in the
reserved blocks. Until every check passes, the blocks belong to no running sequence."""

from __future__ import annotations

import warnings

import torch

from engine import KVReservation
from transfer import KVHeader, TransferError, verify


def check_and_land(header: KVHeader, frames: list[memoryview], res: KVReservation, pool: torch.Tensor) -> None:
    """Raise TransferError (nothing used) or copy every shipped block into its reserved slot."""
    verify(header, frames)
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
    k = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only zmq buffers: only read from here
        for info, buf in zip(header.frames, frames, strict=True):
            src = torch.frombuffer(buf, dtype=torch.uint8).view(pool.dtype).view(info.num_blocks, *pool.shape[1:])
            for j in range(info.num_blocks):
                pool[missing[k]].copy_(src[j])
                k += 1
