"""Property tests of the block manager: the invariants that keep KV memory safe."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.hashing import hash_block, hash_blocks
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_cnt == refs[block.block_id], "ref count differs from the tables that hold it"
        assert (block.block_id in bm.free_queue) == (block.ref_cnt == 0), "block both free and referenced"
    for h, bid in bm.hash_to_block.items():
        assert bm.blocks[bid].block_hash == h


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "free"]), st.integers(0, 10**6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 24))
def test_random_workload_keeps_invariants(ops, block_size, num_blocks):
    bm = BlockManager(num_blocks, block_size)
    live: list[Sequence] = []
    # A small alphabet makes shared prefixes (and so cache hits) common.
    for op, r in ops:
        if op == "add":
            toks = [r % 3, (r // 3) % 3, (r // 9) % 3] * (1 + r % 4)
            seq = Sequence(f"s{r}", toks, len(toks), SamplingParams())
            hit = bm.get_computed_blocks(seq)
            for i, bid in enumerate(hit):
                # A cache hit is never returned for different tokens.
                assert bm.blocks[bid].token_ids == tuple(toks[i * block_size:(i + 1) * block_size])
            if bm.allocate_slots(seq, len(toks) - len(hit) * block_size, hit):
                seq.num_computed_tokens = len(toks)
                bm.cache_full_blocks(seq)
                live.append(seq)
        elif op == "step" and live:
            seq = live[r % len(live)]
            seq.token_ids.append(r % 3)
            if bm.allocate_slots(seq, 1):
                seq.num_computed_tokens += 1
                bm.cache_full_blocks(seq)
            else:
                seq.token_ids.pop()
        elif op == "free" and live:
            bm.free(live.pop(r % len(live)))
        check_invariants(bm, live)
    for s in live:
        bm.free(s)
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    assert bm.num_free_blocks == num_blocks


def test_hash_chain_is_stable_and_positional():
    # Fixed value: every process and machine must derive the same identity for the same prefix.
    assert hash_blocks([1, 2, 3, 4], 2) == [hash_block(0, [1, 2]), hash_block(hash_block(0, [1, 2]), [3, 4])]
    assert hash_block(0, [1, 2]) != hash_block(0, [2, 1])
    assert hash_blocks([1, 2, 3], 2) == hash_blocks([1, 2], 2)  # partial blocks are never hashed
    assert hash_blocks([5, 6, 1, 2], 2)[1] != hash_block(0, [1, 2])  # same tokens, other parent


def test_hash_collision_is_confirmed_by_tokens():
    bm = BlockManager(8, 2)
    a = Sequence("a", [1, 2, 3, 4, 5], 5, SamplingParams())
    assert bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    # Forge a table entry: same hash, other tokens. The lookup must refuse it.
    bm.blocks[a.block_table[0]].token_ids = (9, 9)
    b = Sequence("b", [1, 2, 3, 4, 5], 5, SamplingParams())
    assert bm.get_computed_blocks(b) == []


def test_lru_evicts_tail_blocks_first():
    bm = BlockManager(4, 1)
    a = Sequence("a", [1, 2, 3], 3, SamplingParams())
    bm.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    table = list(a.block_table)
    bm.free(a)
    # Block 3 was never used, then the freed tail comes next: the head of the prefix survives longest.
    assert list(bm.free_queue)[:4] == [3, table[2], table[1], table[0]]
    b = Sequence("b", [7, 7], 2, SamplingParams())
    bm.allocate_slots(b, 2)
    c = Sequence("c", [1, 2, 3, 4], 4, SamplingParams())
    assert bm.get_computed_blocks(c) == table[:2]
