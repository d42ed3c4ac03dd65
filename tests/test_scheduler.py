"""Scheduling policy on plain sequences (the scheduler never touches tensors): short prompts
first, and nothing starves or hangs on the way."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import MAX_DEFERRALS, Scheduler
from engine.sequence import Sequence


def scheduler(first: bool = True, blocks: int = 256, max_seqs: int = 8) -> Scheduler:
    cfg = EngineConfig(model="unused", block_size=16, max_num_batched_tokens=2048, prefill_chunk_size=128,
                       short_prompts_first=first, max_num_seqs=max_seqs)
    return Scheduler(cfg, BlockManager(blocks, 16, enable_prefix_caching=False))


def seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(3, 3 + n)), n, SamplingParams(max_tokens=4), prefill_only=True)


def step(s: Scheduler) -> dict[str, int]:
    """One step, as the engine runs it: computed tokens advance; a finished prompt leaves."""
    out = s.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_tokens_to_compute == 0:
            s.bm.free(item.seq)
            s.remove(item.seq)
    return {item.seq.request_id: item.num_new_tokens for item in out.scheduled}


def test_a_short_prompt_gets_a_step_of_its_own_behind_a_long_one():
    assert EngineConfig(model="unused").short_prompts_first  # on by default
    for first, want in ((True, {"short": 40}), (False, {"long": 128, "short": 40})):
        s = scheduler(first)
        s.add(seq("long", 2048))
        assert step(s) == {"long": 128}
        s.add(seq("short", 40))
        assert step(s) == want, first
        assert step(s) == {"long": 128}  # and the long one goes on


def test_a_long_prompt_waits_at_most_max_deferrals_steps_in_a_row():
    s = scheduler(max_seqs=64)
    s.add(seq("long", 2048))
    step(s)
    steps = []
    for i in range(3 * MAX_DEFERRALS):
        s.add(seq(f"short{i}", 40))  # a new short prompt before every step
        steps.append(step(s))
    ran = ["long" in st for st in steps]
    assert ran[:MAX_DEFERRALS + 1] == [False] * MAX_DEFERRALS + [True]
    assert sum(ran) >= 2 and all(any(k.startswith("short") for k in st) for st in steps)


def test_deferred_chunks_run_when_the_short_prompt_cannot_start():
    s = scheduler(max_seqs=1)  # the long one holds the only batch slot
    s.add(seq("long", 512))
    step(s)
    s.add(seq("short", 40))
    assert step(s) == {"long": 128}  # not an empty step
    later = [step(s) for _ in range(4)]
    assert later[:2] == [{"long": 128}] * 2 and later[2] == {"short": 40}  # then the short one
