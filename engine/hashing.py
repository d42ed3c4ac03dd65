"""Prefix-cache block identity: h_i = xxh3_64(seed, h_{i-1} || tokens_i).

The seed and the byte encoding are fixed so that every process on every machine
(prefill and decode workers alike) derives the same hash for the same prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_SEED = 0x7064_7365_7276_6531  # "pdservE1"
ROOT_HASH = 0


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    h = xxhash.xxh3_64(seed=HASH_SEED)
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.intdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, prior: Sequence[int] = ()) -> list[int]:
    """Hashes of every full block of `token_ids`, reusing the already-known `prior` prefix."""
    hashes = list(prior)
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
