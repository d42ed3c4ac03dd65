"""Continuous-batching scheduler. It never touches tensors: it decides, per step, how many
new tokens each sequence computes under the token budget and returns a plain description.

Running sequences go first (decode tokens, continuing prompt chunks), then waiting ones in
arrival order. When the pool runs dry, the newest running sequence is preempted: its blocks
are freed and it re-enters the queue to be recomputed (by the same catch-up rule).

Short prompts first (`short_prompts_first`): when the next waiting prompt fits in one chunk
and has fewer tokens left than a running prompt, that running prompt's next chunk waits a step
(at most MAX_DEFERRALS steps in a row), so the short one's step is its own and not a long
chunk's. Otherwise a short prompt arriving behind a 2048-token one on a prefill worker (one
thread, 512-token chunks) shared each step with a 512-token chunk, and its TTFT was two such
steps (0.6-1.7 s) where alone it takes 0.1 s. If nothing was admitted after all (no free
slot, no blocks), the deferred chunks run in the same step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus

MAX_DEFERRALS = 4  # steps in a row a running prompt's chunk may wait for shorter prompts


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, yielding logits."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting: dict[str, Sequence] = {}  # imported, KV still arriving: not stepped, but counted
        self.deferrals: dict[str, int] = {}  # running prompt -> steps in a row it waited for shorter ones

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_awaiting(self, seq: Sequence) -> None:
        """An imported sequence whose KV is on its way: it holds a batch slot but is not stepped."""
        seq.status = SequenceStatus.AWAITING_KV
        self.awaiting[seq.request_id] = seq

    def activate(self, seq: Sequence) -> None:
        """Its KV has landed: the sequence joins the decode batch."""
        del self.awaiting[seq.request_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.awaiting.pop(seq.request_id, None)

    @property
    def num_seqs(self) -> int:
        """Sequences holding a batch slot (running or awaiting their KV)."""
        return len(self.running) + len(self.awaiting)

    @property
    def has_free_slot(self) -> bool:
        return self.num_seqs < self.config.max_num_seqs

    @property
    def num_unfinished(self) -> int:
        """Sequences a step can advance (awaiting ones cannot until their KV lands)."""
        return len(self.waiting) + len(self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq.request_id)

    def _to_defer(self, chunk: int) -> set[str]:
        """Running prompts whose next chunk waits for the shorter waiting prompt at the head."""
        if not self.config.short_prompts_first or not self.waiting:
            return set()
        need = self.waiting[0].num_tokens_to_compute
        if need > chunk:
            return set()
        return {seq.request_id for seq in self.running
                if seq.num_tokens_to_compute > max(need, 1) and self.deferrals.get(seq.request_id, 0) < MAX_DEFERRALS}

    def _run(self, out: SchedulerOutput, budget: int, chunk: int, skip: set[str]) -> int:
        """Running sequences' tokens, preempting the newest when the pool runs dry."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens_to_compute, chunk, budget)
            if n <= 0 or seq.request_id in skip:
                i += 1
                continue
            while not self.bm.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, chunk: int) -> tuple[int, int]:
        """Waiting sequences in arrival order; returns the budget left and how many started."""
        admitted = 0
        while self.waiting and budget > 0 and self.has_free_slot:
            seq = self.waiting[0]
            computed = self.bm.get_computed_blocks(seq) if seq.num_computed_tokens == 0 else []
            cached = len(computed) * self.bm.block_size
            n = min(len(seq.token_ids) - max(seq.num_computed_tokens, cached), chunk, budget)
            if not self.bm.allocate_slots(seq, n, computed):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            admitted += 1
        return budget, admitted

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk = self.config.chunk_size
        defer = self._to_defer(chunk)
        budget = self._run(out, budget, chunk, defer)
        admitted = 0
        if not out.preempted:
            budget, admitted = self._admit(out, budget, chunk)
        if defer and not admitted:
            # Nothing shorter started: the deferred chunks run now, without preempting (the
            # newest running sequences may already be in this step).
            for seq in self.running:
                n = min(seq.num_tokens_to_compute, chunk, budget)
                if seq.request_id in defer and n > 0 and self.bm.allocate_slots(seq, n):
                    out.scheduled.append(ScheduledSeq(seq, n))
                    budget -= n
            defer = set()
        self.deferrals = {rid: self.deferrals.get(rid, 0) + 1 for rid in defer}
        return out
