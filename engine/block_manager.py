"""Paged-KV block bookkeeping: ref counts, an LRU free list and prefix caching.

Blocks with ref_cnt == 0 sit in the free queue in eviction order. A freed block
keeps its hash (and stays findable in the prefix cache) until it is reused.
Sequences are freed tail-first so that their tail blocks are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.hashing import hash_blocks
from engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.total_refs = 0  # sum of ref counts: equals the live sequences' block-table lengths

    # ---- stats -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including evictable cached ones)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache ------------------------------------------------------------------------
    def _lookup(self, hashes: Seq[int], token_ids: Seq[int]) -> list[int]:
        hit: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            bid = self.hash_to_block.get(h)
            if bid is None:
                break
            # A hash match alone is not trusted: confirm with the token ids.
            if self.blocks[bid].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            hit.append(bid)
        return hit

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Leading cached blocks for a fresh sequence. At least one token is always left to
        compute, so a fully cached prompt still yields logits for its last position."""
        if not self.enable_prefix_caching:
            return []
        seq.block_hashes = hash_blocks(seq.token_ids, self.block_size, seq.block_hashes)
        if seq.needs_prompt_logprobs:
            return []  # its blocks are still hashed, so that they are published once computed
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        return self._lookup(seq.block_hashes[:max_blocks], seq.token_ids)

    def lookup(self, hashes: Seq[int], token_ids: Seq[int]) -> list[int]:
        """Leading cached blocks for a whole hash chain (every full block may hit, unlike
        `get_computed_blocks`, because an importer computes no token itself)."""
        return self._lookup(hashes, token_ids) if self.enable_prefix_caching else []

    # ---- allocation --------------------------------------------------------------------------
    def _touch(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_cnt == 0:
            del self.free_queue[bid]
        block.ref_cnt += 1
        self.total_refs += 1

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == bid:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_cnt = 1
        self.total_refs += 1
        return bid

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: Seq[int] = ()) -> bool:
        """num_new_tokens counts tokens past the computed ones (and past `computed` hits)."""
        done = len(computed) * self.block_size if computed else seq.num_computed_tokens
        need = self.blocks_needed(done + num_new_tokens) - len(seq.block_table) - len(computed)
        # Hits sitting in the free queue (ref 0) are taken out of it too.
        reusable = sum(1 for b in computed if self.blocks[b].ref_cnt == 0)
        return max(need, 0) + reusable <= len(self.free_queue)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: Seq[int] = ()) -> bool:
        """Make `seq.block_table` cover num_computed_tokens + num_new_tokens tokens.

        `computed` are prefix-cache hits (only for a sequence with no blocks yet). Returns
        False, changing nothing, when the free list cannot cover it."""
        if computed and seq.block_table:
            raise ValueError("prefix hits can only seed an empty block table")
        if not self.can_allocate(seq, num_new_tokens, computed):
            return False
        for bid in computed:
            self._touch(bid)
        if self.enable_prefix_caching and seq.num_computed_tokens == 0 and not seq.block_table:
            self.prefix_queries += len(seq.token_ids)
            self.prefix_hits += len(computed) * self.block_size
        if computed:
            seq.block_table.extend(computed)
            seq.num_computed_tokens = len(computed) * self.block_size
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.num_registered_blocks = len(computed)
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(max(need, 0)):
            seq.block_table.append(self._pop_free())
        return True

    def allocate_blocks(self, n: int) -> list[int] | None:
        """Raw blocks for an incoming transfer; None when the pool cannot cover them."""
        if n > len(self.free_queue):
            return None
        return [self._pop_free() for _ in range(n)]

    def acquire(self, block_ids: Seq[int]) -> None:
        for bid in block_ids:
            self._touch(bid)

    def free_blocks(self, block_ids: Seq[int]) -> None:
        # Reverse order: tail blocks land nearer the front of the free queue, so they go first.
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {bid}")
            block.ref_cnt -= 1
            self.total_refs -= 1
            if block.ref_cnt == 0:
                self.free_queue[bid] = None

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed (computed and full) blocks."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        bs = self.block_size
        if len(seq.block_hashes) < num_full:
            seq.block_hashes = hash_blocks(seq.token_ids[:num_full * bs], bs, seq.block_hashes)
        for i in range(seq.num_registered_blocks, num_full):
            self.register_block(seq.block_table[i], seq.block_hashes[i], seq.token_ids[i * bs:(i + 1) * bs])
        seq.num_registered_blocks = num_full

    def register_block(self, bid: int, block_hash: int, token_ids: Seq[int]) -> None:
        block = self.blocks[bid]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        # Keep the first block published under a hash; a duplicate simply stays unshared.
        self.hash_to_block.setdefault(block_hash, bid)
