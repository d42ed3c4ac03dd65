"""Routing policies on hand-built worker records: prefill goes where the fewest prompt tokens
stand before this one, and a warm prefix cache counts as tokens already computed."""

from __future__ import annotations

from router.membership import WorkerRecord
from router.policy import LeastLoaded, PrefixAware

BLOCK = 16


def worker(wid: str, queued: list[int] = ()) -> WorkerRecord:
    w = WorkerRecord(wid, "prefill", f"{wid}:1", f"{wid}:2", num_blocks=1000, block_size=BLOCK, channel=None, stub=None)
    for i, n in enumerate(queued):
        w.queued[f"{wid}-{i}"] = n
        w.inflight[f"{wid}-{i}"] = lambda code, msg: None
    return w


def test_least_loaded_counts_tokens_not_requests():
    # One 8k-token prompt is a longer queue than three short ones.
    long_one, short_three = worker("a", [8192]), worker("b", [100, 100, 100])
    assert LeastLoaded().pick_prefill([long_one, short_three], [], 512) is short_three


def test_prefix_holder_wins_when_its_hit_outweighs_its_queue():
    policy = PrefixAware()
    prefix = list(range(1, 65))  # 64 blocks = 1024 tokens
    holder, idle = worker("h", [300]), worker("i")
    policy.record(prefix, "h", "d")
    # 1100-token prompt: the holder computes 300 + 76 tokens, the idle worker 1100.
    assert policy.pick_prefill([idle, holder], prefix, 1100) is holder
    assert policy.expected_cached(holder, prefix, 1100) == 1024
    assert policy.expected_cached(idle, prefix, 1100) == 0


def test_prefix_holder_loses_when_its_queue_outweighs_the_hit():
    # What counting requests got wrong: two 8k prompts queued at the holder of a 1k prefix
    # cost far more than computing that prefix again on an idle worker.
    policy = PrefixAware()
    prefix = list(range(1, 65))
    holder, idle = worker("h", [8192, 8192]), worker("i")
    policy.record(prefix, "h", "d")
    assert policy.pick_prefill([holder, idle], prefix, 1100) is idle


def test_partial_prefix_counts_only_the_blocks_held():
    policy = PrefixAware()
    shared, mine = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]
    policy.record(shared, "h", "d")
    h = worker("h")
    assert policy.expected_cached(h, mine, 8 * BLOCK) == 4 * BLOCK
    # The last prompt token is always computed (it yields the first output token).
    assert policy.expected_cached(h, shared, 4 * BLOCK) == 4 * BLOCK - 1
