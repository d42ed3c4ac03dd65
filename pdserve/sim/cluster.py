"""A discrete-event simulation of a whole pdserve cluster, driven by step-cost profiles.

It follows the router's request path (ARCHITECTURE.md): admission reserves prompt + output KV
on a decode worker with room (or the request waits in the router's FIFO queue), the prefill
worker is the one with the fewest prompt tokens to compute before this prompt's first token
(with prefix-aware routing, the blocks the router believes a worker holds are free there, as in
router/policy.py); the first token leaves at the end of the prefill
step; the KV ships (the profile's transfer time) and the sequence joins its decode worker's
batch at the next step boundary. A one-token request in disaggregated mode skips admission.

The planner runs in the loop every interval, on the same observations the live router would
hand it; new workers serve after `startup_s`; removed workers drain (no new work, finish what
they hold) and count toward worker-hours until they are empty.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdcommon.step_cost import StepCostModel
from pdserve.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest
from pdserve.sim.workers import SimRequest, SimWorker, run_time, steps_done
from router.planner import Arrival, Decision, Finished, Observation, Planner, Slos

SCAN_LIMIT = 1024  # pools larger than this are routed by the best of SAMPLE random workers (the live
# router scans them all: with best-of-8 from 16 workers up, a prompt landed behind minutes of long
# ones while others idled, and at 256 workers the Mooncake TTFT attainment fell 8 points)
SAMPLE = 8


@dataclass(slots=True)
class SimSettings:
    profile: StepCostModel  # prefill (or colocated) workers
    decode_profile: StepCostModel | None = None  # decode workers; None: the same
    mode: str = "disaggregated"
    budget: int = 2048  # a worker's token budget per step
    slos: Slos = field(default_factory=lambda: Slos(None, None, 3.0, 2.0))
    startup_s: float = 30.0
    interval_s: float = 30.0
    routing: str = "prefix_aware"
    max_tail_s: float = 3600.0  # stop this long after the last arrival, whatever is left
    seed: int = 0
    # Calibration: served steps take this many times the profile's (the profile times the engine
    # alone; serving beside a router, RPC threads and a client on the same cores slows it).
    # Steps with prompt work scale by prefill_scale, pure decode steps by decode_scale.
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    # ...and each sequence in a step costs this much more than the profile says: streaming its
    # token through the worker, the router and the client takes CPU from the engine.
    seq_overhead_s: float = 0.0

    @property
    def roles(self) -> tuple[str, ...]:
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")


@dataclass(slots=True)
class SimResult:
    requests: list[SimRequest]
    workers: list[SimWorker]
    decisions: list[Decision]
    timeline: list[tuple[float, dict[str, int]]]  # (time, serving + starting workers per pool)
    end_s: float


class Cluster:
    def __init__(self, settings: SimSettings, planner: Planner, initial: dict[str, int]) -> None:
        self.s = settings
        self.planner = planner
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.rng = random.Random(settings.seed)
        self.workers: list[SimWorker] = []
        self.up: dict[str, list[SimWorker]] = {r: [] for r in settings.roles}
        self.queue: deque[SimRequest] = deque()
        self.owner: OrderedDict[int, SimWorker] = OrderedDict()  # prefix block -> prefill worker
        # Each pool's up workers by their routing key (_route_key): each change pushes the worker's
        # new key and stale ones are dropped when they surface, so routing a request is a heap
        # peek, not a scan of the pool (which was most of a 256-worker simulation).
        self.by_key: dict[str, list[tuple[int, int, int, SimWorker]]] = {r: [] for r in settings.roles}
        self.done: list[SimRequest] = []
        self.window_arrivals: list[Arrival] = []
        self.window_finished: list[Finished] = []
        self.window_failed = 0
        self.window_prompt = self.window_cached = 0
        self.decisions: list[Decision] = []
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.remaining = 0
        decode = settings.decode_profile or settings.profile
        self.max_kv = (decode if settings.mode == "disaggregated" else settings.profile).kv_capacity_tokens or 1 << 40
        for role, n in initial.items():
            for _ in range(n):
                self._ready(self._new_worker(role))
        self._mark()

    # ---- the event loop -------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self, trace: list[TraceRequest]) -> SimResult:
        memo: dict = {}
        reqs = [self._request(i, r, memo) for i, r in enumerate(trace)]
        self.remaining = len(reqs)
        for r in reqs:
            self.at(r.arrival, self._arrive, r)
        last = reqs[-1].arrival if reqs else 0.0
        self.at(self.s.interval_s, self._tick)
        while self.events and self.remaining:
            t, _, fn, args = heapq.heappop(self.events)
            if t > last + self.s.max_tail_s:
                break
            self.now = t
            fn(*args)
        end = max([last] + [r.finish for r in reqs if r.finish is not None])
        for w in self.workers:
            w.ended = w.ended if w.ended is not None else end
        return SimResult(reqs, self.workers, self.decisions, self.timeline, end)

    def _request(self, i: int, r: TraceRequest, memo: dict) -> SimRequest:
        s = self.s
        key = (r.prompt_len, r.output_len)
        if key not in memo:
            memo[key] = (s.slos.ttft(s.profile, r.prompt_len, 0, s.budget),
                         s.slos.tpot(s.decode_profile or s.profile, r.prompt_len, r.output_len))
        ttft, tpot = memo[key]
        return SimRequest(i, r.arrival_s, r.prompt_len, max(r.output_len, 1), r.hash_ids, ttft_slo=ttft, tpot_slo=tpot)

    # ---- workers --------------------------------------------------------------------------
    def _new_worker(self, role: str) -> SimWorker:
        prof = self.s.decode_profile if role == "decode" and self.s.decode_profile else self.s.profile
        w = SimWorker(len(self.workers), role, prof, self.s.budget, self.now)
        w.kv_free = prof.kv_capacity_tokens or 1 << 40
        w.cache_blocks = (prof.kv_capacity_tokens or 0) // MOONCAKE_BLOCK_TOKENS
        self.workers.append(w)
        return w

    def _ready(self, w: SimWorker) -> None:
        if w.state != "starting":
            return  # removed while starting
        w.state = "up"
        self.up[w.role].append(w)
        self._rekey(w)
        self._admit()

    def _gone(self, w: SimWorker) -> None:
        w.state, w.ended = "gone", self.now

    def kick(self, w: SimWorker) -> None:
        """New work for w: start a step, or cut a decode run at the step in flight."""
        if not w.busy:
            self._step(w)
            return
        if w.run is not None and not w.cut:
            start, c0, c1, k = w.run
            j = steps_done(c0, c1, self.now - start) + 1
            if j < k:
                w.version += 1
                w.cut = True
                self.at(start + run_time(c0, c1, j), self._run_end, w, w.version, j)

    def _step(self, w: SimWorker) -> None:
        for req in w.joining:
            w.add_decode(req)
        w.joining.clear()
        w.run = None
        if w.queue:
            plan = w.plan_chunks()
            for req, _ in plan:
                if req.prefill_start is None:
                    req.prefill_start = self.now
            dt = self.s.prefill_scale * w.profile.step_seconds_total([(n, r.done + n) for r, n in plan], len(w.batch),
                                                                     w.context_sum())
            dt += self.s.seq_overhead_s * (len(plan) + len(w.batch))
            w.busy = True
            self.at(self.now + dt, self._step_end, w, plan)
        elif w.batch:
            b = len(w.batch)
            k = w.batch[0][0] - w.steps
            scale = self.s.decode_scale
            c0 = scale * w.profile.step_seconds_total([], b, w.context_sum()) + self.s.seq_overhead_s * b
            c1 = scale * w.profile.decode_attention_s * b  # each step reads one more token per sequence
            w.busy, w.cut = True, False
            w.version += 1
            w.run = (self.now, c0, c1, k)
            self.at(self.now + run_time(c0, c1, k), self._run_end, w, w.version, k)
        else:
            w.busy = False
            if w.state == "draining" and w.idle:
                self._gone(w)

    def _run_end(self, w: SimWorker, version: int, k: int) -> None:
        if version != w.version:
            return
        for req in w.advance(k):
            self._finish(req, w)
        self._step(w)

    def _step_end(self, w: SimWorker, plan: list) -> None:
        if w.batch:
            for req in w.advance(1):
                self._finish(req, w)
        for req, n in plan:
            req.done += n
            w.queued -= n
            if req.done >= req.prompt_len:
                w.queue.remove(req)
                self._prefilled(req, w)
        self._rekey(w)
        self._step(w)

    # ---- the request path -----------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        if req.kv_tokens > self.max_kv:  # no worker can ever hold it: the router refuses it at once
            req.rejected = True
            self.remaining -= 1
            self.window_failed += 1
            return
        self.window_arrivals.append(Arrival(req.prompt_len, req.output_len, at_s=req.arrival))
        self.queue.append(req)
        self._admit()

    def _prefilled(self, req: SimRequest, w: SimWorker) -> None:
        req.first = self.now
        w.remember(req.hash_ids)
        if w.role == "colocated":
            if req.output_len <= 1:
                self._finish(req, w)
            else:
                w.add_decode(req)
            return
        w.load -= 1
        self._rekey(w)
        if req.output_len <= 1:
            self._record(req)
        else:
            prof = self.s.profile
            self.at(self.now + prof.transfer_seconds(req.prompt_len - req.cached), self._land, req)
        if w.state == "draining" and w.idle:
            self._gone(w)

    def _land(self, req: SimRequest) -> None:
        d = req.decoder
        d.joining.append(req)
        self.kick(d)

    def _finish(self, req: SimRequest, w: SimWorker) -> None:
        w.load -= 1
        w.kv_free += req.kv_tokens
        self._rekey(w)
        self._record(req)
        self._admit()
        if w.state == "draining" and w.idle and not w.busy:
            self._gone(w)

    def _record(self, req: SimRequest) -> None:
        req.finish = self.now
        self.remaining -= 1
        self.done.append(req)
        tpot = (req.finish - req.first) / (req.output_len - 1) if req.output_len > 1 else 0.0
        self.window_finished.append(Finished(req.prompt_len, req.output_len, req.queue_s, req.first - req.arrival,
                                             tpot, req.ttft_slo, req.tpot_slo, req.rode))

    def _admit(self) -> None:
        colocated = self.s.mode == "colocated"
        while self.queue:
            req = self.queue[0]
            needs_decode = colocated or req.output_len > 1
            d = self._pick(self.up["colocated" if colocated else "decode"], req) if needs_decode else None
            if needs_decode and d is None:
                return
            p = d if colocated else self._pick_prefill(req)
            if p is None:
                return
            self.queue.popleft()
            if d is not None:
                d.kv_free -= req.kv_tokens
                d.load += 1
                req.decoder = d
                self._rekey(d)
            if not colocated:
                p.load += 1
            hits = p.lookup(req.hash_ids)
            req.cached = req.done = min(hits * MOONCAKE_BLOCK_TOKENS, req.prompt_len - 1)
            self.window_prompt += req.prompt_len
            self.window_cached += req.cached
            p.queue.append(req)
            p.queued += req.prompt_len - req.done
            self._rekey(p)
            self.kick(p)

    def _candidates(self, pool: list[SimWorker]) -> list[SimWorker]:
        """SAMPLE random workers of a pool larger than SCAN_LIMIT (smaller ones route by heap)."""
        n, pick = len(pool), self.rng.randrange
        return [pool[pick(n)] for _ in range(SAMPLE)]

    def _pick(self, pool: list[SimWorker], req: SimRequest) -> SimWorker | None:
        need = req.kv_tokens
        if len(pool) <= SCAN_LIMIT:
            return self._least_loaded_fitting(need) if pool else None
        for cands in (self._candidates(pool), pool):
            fits = [w for w in cands if w.kv_free >= need]
            if fits:
                return min(fits, key=lambda w: (w.load, -w.kv_free, w.wid))
        return None

    def _pick_prefill(self, req: SimRequest) -> SimWorker | None:
        pool = self.up["prefill"]
        if not pool:
            return None
        holder, saved, holder_up = None, 0, False
        if self.s.routing == "prefix_aware" and req.hash_ids:
            depth = next((i + 1 for i in range(len(req.hash_ids) - 1, -1, -1) if req.hash_ids[i] in self.owner), 0)
            holder = self.owner[req.hash_ids[depth - 1]] if depth else None
            holder_up = holder is not None and holder.state == "up"
            if holder_up:
                saved = min(depth * MOONCAKE_BLOCK_TOKENS, req.prompt_len - 1)
        if len(pool) <= SCAN_LIMIT:
            # The whole pool (the holder, when up, is in it): its least-queued worker, unless the
            # holder is less, counting the prompt tokens its cache saves.
            top = self._fresh_heap("prefill")[0]
            best = holder if saved and (holder.queued - saved, holder.load, holder.wid) < top[:3] else top[3]
        else:
            cands = self._candidates(pool)
            if holder_up and holder not in cands:
                cands.append(holder)
            best = min(cands, key=lambda w: (w.queued_tokens - (saved if w is holder else 0), w.load, w.wid))
        if self.s.routing == "prefix_aware" and req.hash_ids:
            for h in req.hash_ids:
                self.owner[h] = best
                self.owner.move_to_end(h)
            while len(self.owner) > 100_000:
                self.owner.popitem(last=False)
        return best

    @staticmethod
    def _route_key(w: SimWorker) -> tuple[int, int, int]:
        """Prefill: (queued tokens, load, id); decode and colocated: (load, -free KV, id)."""
        return (w.queued, w.load, w.wid) if w.role == "prefill" else (w.load, -w.kv_free, w.wid)

    def _current(self, entry: tuple[int, int, int, SimWorker]) -> bool:
        """Whether a heap entry still holds its worker's key (else it is stale: skip it)."""
        return entry[3].state == "up" and entry[:3] == self._route_key(entry[3])

    def _rekey(self, w: SimWorker) -> None:
        if w.state == "up":
            heapq.heappush(self.by_key[w.role], (*self._route_key(w), w))

    def _fresh_heap(self, role: str) -> list[tuple[int, int, int, SimWorker]]:
        """The pool's heap with a current entry on top (or empty): stale tops popped, and the
        whole heap rebuilt once stale entries outnumber the pool."""
        heap, pool = self.by_key[role], self.up[role]
        if len(heap) > 8 * len(pool) + 64:
            heap[:] = [(*self._route_key(w), w) for w in pool]
            heapq.heapify(heap)
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        return heap

    def _least_loaded_fitting(self, need: int) -> SimWorker | None:
        """The up decode (colocated) worker with the least (load, -free KV, id) among those with
        `need` KV tokens free, or None."""
        heap = self._fresh_heap("colocated" if self.s.mode == "colocated" else "decode")
        skipped, found = [], None
        while heap:
            entry = heapq.heappop(heap)
            if not self._current(entry):
                continue
            w = entry[3]
            skipped.append(entry)
            if w.kv_free >= need:
                found = w
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    # ---- the planner ----------------------------------------------------------------------
    def _tick(self) -> None:
        start = self.now - self.s.interval_s
        obs = Observation(start, self.now, self.window_arrivals, self.window_finished, self.window_prompt,
                          self.window_cached, waiting=len(self.queue) + sum(len(w.queue) for w in self.workers),
                          failed=self.window_failed)
        self.window_arrivals, self.window_finished, self.window_failed = [], [], 0
        self.window_prompt = self.window_cached = 0
        current = self._counts()
        decision = self.planner.plan(obs, current)
        self.decisions.append(decision)
        for role in self.s.roles:
            self._resize(role, current[role], decision.desired.get(role, current[role]))
        self._mark()
        if self.remaining:
            self.at(self.now + self.s.interval_s, self._tick)

    def _counts(self) -> dict[str, int]:
        counts = {r: 0 for r in self.s.roles}
        for w in self.workers:
            if w.state in ("starting", "up"):
                counts[w.role] += 1
        return counts

    def _mark(self) -> None:
        self.timeline.append((self.now, self._counts()))

    def _resize(self, role: str, have: int, want: int) -> None:
        for _ in range(want - have):
            self.at(self.now + self.s.startup_s, self._ready, self._new_worker(role))
        if want >= have:
            return
        starting = [w for w in self.workers if w.role == role and w.state == "starting"]
        victims = starting[: have - want]
        victims += sorted(self.up[role], key=lambda w: (w.load, w.wid))[: have - want - len(victims)]
        for w in victims:
            if w.state == "up":
                self.up[role].remove(w)
            w.state = "draining"
            if w.idle and not w.busy:
                self._gone(w)


def worker_hours(result: SimResult) -> float:
    return sum((w.ended - w.started) for w in result.workers if w.ended is not None) / 3600.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]
