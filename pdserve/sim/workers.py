"""Simulated workers: engine steps timed by the step-cost profile.

A worker runs the engine's loop: each step takes the running decodes plus prompt chunks up to
the token budget (chunked prefill, FIFO). With no prompt waiting, a decode batch is constant
until a sequence finishes, so the simulator jumps over those steps in one event (a decode step's
cost grows by one token of context per sequence per step: an arithmetic series). A sequence
that joins mid-run waits for the step in flight to end, as in the engine.

Roles: `prefill` hands a finished prompt to the cluster (KV transfer, then its decode worker);
`decode` only decodes; `colocated` does both, and a prompt's sequence stays where it is.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdcommon.step_cost import StepCostModel


@dataclass(slots=True)
class SimRequest:
    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    ttft_slo: float = math.inf
    tpot_slo: float = math.inf
    cached: int = 0
    done: int = 0  # prompt tokens computed
    decoder: SimWorker | None = None
    prefill_start: float | None = None
    first: float | None = None
    finish: float | None = None
    end_step: int = 0  # the decode worker's step count at which the last token comes
    rejected: bool = False  # needs more KV than a worker has
    mark: tuple[int, int] = (0, 0)  # its decode worker's (batch_steps, steps) when it joined the batch
    rode: float | None = None  # the mean batch of its decode steps, as a worker reports it

    @property
    def queue_s(self) -> float:
        return (self.prefill_start if self.prefill_start is not None else self.arrival) - self.arrival

    @property
    def kv_tokens(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(eq=False, slots=True)
class SimWorker:
    wid: int
    role: str
    profile: StepCostModel
    budget: int
    started: float
    state: str = "starting"  # starting -> up -> draining -> gone
    ended: float | None = None
    load: int = 0  # requests in flight here (the router's routing signal)
    kv_free: int = 0
    queue: deque = field(default_factory=deque)  # prompts waiting or part-way
    queued: int = 0  # their prompt tokens still to compute, kept as they move
    batch: list = field(default_factory=list)  # heap of (end_step, rid, request)
    joining: list = field(default_factory=list)
    steps: int = 0  # decode steps taken
    batch_steps: int = 0  # the sum over decode steps of the batch's size
    ctx_base: int = 0  # sum over the batch of (context - steps): the batch's context is this + B * steps
    busy: bool = False
    version: int = 0  # invalidates a scheduled run end when a join cuts it short
    run: tuple | None = None  # (start, c0, c1, steps) of the decode run in flight
    cut: bool = False
    cache: OrderedDict = field(default_factory=OrderedDict)  # prefix block ids, LRU
    cache_blocks: int = 0

    # ---- decode batch ---------------------------------------------------------------------
    def add_decode(self, req: SimRequest) -> None:
        remaining = req.output_len - 1
        req.end_step = self.steps + remaining
        req.mark = (self.batch_steps, self.steps)
        heapq.heappush(self.batch, (req.end_step, req.rid, req))
        self.ctx_base += req.prompt_len + 1 - self.steps

    def context_sum(self) -> int:
        return self.ctx_base + len(self.batch) * self.steps

    def advance(self, k: int) -> list[SimRequest]:
        """k decode steps: the sequences that emitted their last token."""
        self.batch_steps += len(self.batch) * k
        self.steps += k
        out = []
        while self.batch and self.batch[0][0] <= self.steps:
            _, _, req = heapq.heappop(self.batch)
            if self.steps > req.mark[1]:
                req.rode = (self.batch_steps - req.mark[0]) / (self.steps - req.mark[1])
            self.ctx_base -= req.prompt_len + 1 - (req.end_step - (req.output_len - 1))  # as add_decode put it
            out.append(req)
        return out

    # ---- prompt chunks --------------------------------------------------------------------
    def plan_chunks(self) -> list[tuple[SimRequest, int]]:
        room = self.budget - len(self.batch)
        plan = []
        for req in self.queue:
            if room <= 0:
                break
            n = min(room, req.prompt_len - req.done)
            plan.append((req, n))
            room -= n
        return plan

    def lookup(self, hash_ids: tuple[int, ...]) -> int:
        """Leading prefix blocks held (Mooncake's 512-token blocks)."""
        hits = 0
        for h in hash_ids:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hits += 1
        return hits

    def remember(self, hash_ids: tuple[int, ...]) -> None:
        for h in hash_ids:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)

    @property
    def idle(self) -> bool:
        return self.load == 0 and not self.queue and not self.batch and not self.joining

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute here (the router's routing signal for prefill): kept
        as a count, not summed over the queue, since routing asks every worker of the pool for
        it on every request (at 512 workers that sum was most of a simulation's time)."""
        return self.queued


def run_time(c0: float, c1: float, k: int) -> float:
    """Seconds for k decode steps whose costs are c0, c0 + c1, c0 + 2 c1, ..."""
    return k * c0 + c1 * k * (k - 1) / 2


def steps_done(c0: float, c1: float, elapsed: float) -> int:
    """Whole steps of such a run finished after `elapsed` seconds."""
    if c0 <= 0 and c1 <= 0:
        return 0
    if c1 <= 0:
        k = int(elapsed / c0)
    else:  # k c0 + c1 k (k - 1) / 2 <= elapsed: the positive root
        b = c0 - c1 / 2
        k = int((-b + math.sqrt(b * b + 2 * c1 * elapsed)) / c1)
    # then fix floating-point rounding either way, by the same sum run_time computes
    while k > 0 and run_time(c0, c1, k) > elapsed:
        k -= 1
    while run_time(c0, c1, k + 1) <= elapsed:
        k += 1
    return k
