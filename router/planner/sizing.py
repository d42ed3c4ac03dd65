"""How many workers a pool needs for a load, from the step-cost profile.

- **Prefill** is a queue in front of c servers. A request's TTFT is its wait plus its own prefill
  time, so the SLO leaves each request a wait budget (its SLO less its prefill time). With timed
  arrivals (the router's), the recent ones are replayed through c servers (replay.py). Without,
  the wait comes from M/G/c: Erlang C for the chance to wait at all, and an exponential tail whose rate
  is the pool's spare capacity, stretched by the Allen-Cunneen factor (ca^2 + cs^2) / 2 for
  arrivals and prompt lengths that vary more (or less) than Poisson and exponential. The
  predicted attainment is the mean, over a sample of recent requests, of P(wait <= budget).
- **Decode** is a batch that every request rides for its whole output. By Little's law the
  pool holds rate x output x ITL sequences, spread over the workers by least-loaded routing
  (decode_attainment). The ITL at that batch and the requests'
  context, plus the KV transfer spread over the output (the first decoded token waits for it),
  must meet each request's TPOT SLO; the batch's KV reservations must fit the KV capacity.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcommon.step_cost import StepCostModel
from router.planner.arrivals import sample_rate
from router.planner.base import Arrival
from router.planner.replay import MIN_ARRIVALS, replay_met, with_backlog

DIMINISHING, NEAR = 0.005, 0.05  # attainment that doubling a pool must still buy, near the goal
REACH_MARGIN = 0.01  # attainment is approached only as pools grow without end: stop this short of it


def erlang_c(c: int, a: float) -> float:
    """P(an arrival waits) in M/M/c with offered load a = rate x mean service (Erlang B recursion,
    stable for hundreds of servers)."""
    if a <= 0:
        return 0.0
    if a >= c:
        return 1.0
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1 - rho * (1 - b))


def normal_quantile(p: float) -> float:
    return statistics.NormalDist().inv_cdf(min(max(p, 1e-6), 1 - 1e-6))


@dataclass(frozen=True, slots=True)
class Slos:
    """Absolute SLOs where given, else per request: factor x its unloaded time."""

    ttft_s: float | None
    tpot_s: float | None
    ttft_factor: float
    tpot_factor: float

    def ttft(self, profile: StepCostModel, prompt_len: int, cached: int, chunk: int | None) -> float:
        return self.ttft_s or self.ttft_factor * profile.prefill_seconds(prompt_len, cached, chunk)

    def tpot(self, profile: StepCostModel, prompt_len: int, output_len: int) -> float:
        return self.tpot_s or self.tpot_factor * profile.itl_seconds(1, prompt_len + max(output_len, 1) // 2)


@dataclass(slots=True)
class Terms:
    """Per-request quantities of a sample, computed once per plan."""

    service: list[float]  # unloaded prefill seconds (before correction)
    ttft_slo: list[float]
    # Per multi-token request: (its TPOT SLO less its KV transfer share, its own decode context).
    tpot_room: list[tuple[float, int]]
    single: int  # one-token requests (no TPOT)
    outputs: list[int]
    mean_output: float
    context: int  # decode context of a batch resident: prompt + half the output, weighed by output
    kv_tokens: float  # KV reservation of a batch resident: prompt + output, weighed by output
    service_mean: float
    service_cv2: float  # squared coefficient of variation of the prefill time
    # The share of the sample a worker can hold at all (prompt + output within the KV capacity):
    # the router refuses the rest, so they never reach a queue, and they count as misses.
    kept: float = 1.0
    # The context of a batch neighbour, as NEIGHBOURS equally likely values (output-weighted
    # quantiles): a short request beside one 60k-token context misses a TPOT SLO that the mean
    # neighbour lets it meet, and long-context traces are heavy-tailed.
    neighbours: list[float] = field(default_factory=list)
    # What the prefill replay runs: the kept requests of the replay window as (arrival time,
    # service, TTFT SLO), in order, with the backlog's work among them (SLO None), and the
    # window's arrival rate (refused ones too). Empty when the sample is not timed.
    replay: list[tuple[float, float, float | None]] = field(default_factory=list)
    own_rate: float = 0.0
    _rooms: dict = field(default_factory=dict)
    # Attainments already computed, by pool, workers, rate, correction and model: the planner tries
    # several splits of the misses per interval, which ask for the same points.
    _seen: dict = field(default_factory=dict)

    def once(self, key: tuple, compute):
        """What `compute` gives, computed once per key for this sample."""
        got = self._seen.get(key)
        if got is None:
            got = self._seen[key] = compute()
        return got

    def rooms(self, profile: StepCostModel, correction: float) -> list[float]:
        """Sorted: the step time each request can spend on the rest of its batch. A step is
        g(B) + a_seq B + a_decode (own context + the others'), times the correction; what is
        left of (SLO - transfer share) / correction after its own context's attention."""
        got = self._rooms.get(correction)
        if got is None:
            got = self._rooms[correction] = sorted(room / correction - profile.decode_attention_s * ctx
                                                   for room, ctx in self.tpot_room)
        return got


@dataclass(slots=True)
class PoolModel:
    """The two pools' predictions for a sample of requests (the planner's recent arrivals)."""

    profile: StepCostModel
    slos: Slos
    chunk: int | None = None  # the prefill pool's token budget (None: a prompt in one step)
    # KV tokens a worker can reserve for one request (the decode pool's capacity): bigger ones
    # are refused by the router. Left in the sample, a trace's 2% of 100k-token prompts made the
    # mean prefill time 1.6x what the served ones need, and the prefill pool as much too big.
    max_kv_tokens: int | None = None
    # Seconds a decode reservation is held before its sequence decodes (the router reserves the
    # KV before the prefill starts): the prefill pool's mean service time, set by the planner.
    hold_s: float = 0.0
    arrival_cv2: float = 1.0
    memo: dict = field(default_factory=dict)

    def _request_terms(self, a: Arrival) -> tuple[float, float, float | None]:
        """(unloaded prefill seconds, TTFT SLO, TPOT room or None), memoized: a sample holds
        thousands of requests and lengths repeat."""
        key = (a.prompt_len, a.cached_len, a.output_len)
        got = self.memo.get(key)
        if got is None:
            p = self.profile
            s = p.prefill_seconds(a.prompt_len, a.cached_len, self.chunk)
            room = None
            if a.output_len > 1:
                room = (self.slos.tpot(p, a.prompt_len, a.output_len)
                        - p.transfer_seconds(a.prompt_len - a.cached_len) / (a.output_len - 1))
            got = self.memo[key] = (s, self.slos.ttft_s or self.slos.ttft_factor * s, room)
            if len(self.memo) > 1 << 16:
                self.memo.clear()
        return got

    def terms(self, sample: Sequence[Arrival], since: float | None = None, backlog: int = 0) -> Terms:
        """The sample's terms; the prefill replay runs its arrivals from `since` on (at least
        its last MIN_ARRIVALS): the stretch whose rate the forecast measured, behind `backlog`
        requests queued now (no first token yet)."""
        n = len(sample)
        timed = n >= MIN_ARRIVALS and all(a.at_s is not None for a in sample)
        window = {}
        if timed:
            sample = sorted(sample, key=lambda a: a.at_s)
            times = [a.at_s for a in sample]
            first = min(bisect.bisect_left(times, since) if since is not None else 0, n - MIN_ARRIVALS)
            window = {"start": times[first], "own_rate": sample_rate(times[first:], n - first)}
        if self.max_kv_tokens:
            sample = [a for a in sample if a.prompt_len + a.output_len <= self.max_kv_tokens]
        kept = len(sample) / n if n else 1.0
        rows = [self._request_terms(a) for a in sample]
        contexts = [a.prompt_len + a.output_len / 2 for a in sample]  # a decode resident's, mid-output
        service = [r[0] for r in rows]
        mean = statistics.fmean(service) if service else 0.0
        return Terms(service=service, ttft_slo=[r[1] for r in rows],
                     tpot_room=[(r[2], a.prompt_len + a.output_len // 2) for r, a in zip(rows, sample, strict=True)
                                if r[2] is not None],
                     single=sum(r[2] is None for r in rows),
                     outputs=[a.output_len for a in sample],
                     mean_output=statistics.fmean(a.output_len for a in sample) if sample else 0.0,
                     context=round(_resident_mean(contexts, sample)),
                     kv_tokens=_resident_mean([a.prompt_len + a.output_len for a in sample], sample),
                     service_mean=mean,
                     service_cv2=statistics.pvariance(service) / (mean * mean) if mean > 0 else 0.0,
                     kept=kept, neighbours=_weighted_points(contexts, [max(a.output_len, 1) for a in sample]),
                     own_rate=window.get("own_rate", 0.0),
                     replay=with_backlog([(a.at_s, r[0], r[1]) for a, r in zip(sample, rows, strict=True)
                                          if a.at_s >= window["start"]], backlog, mean)
                     if window.get("own_rate") else [])

    # ---- prefill --------------------------------------------------------------------------
    def prefill_attainment(self, workers: int, rate: float, t: Terms, correction: float = 1.0) -> float:
        return t.once(("prefill", workers, rate, correction, self.arrival_cv2),
                      lambda: self._prefill_attainment(workers, rate, t, correction))

    def _prefill_attainment(self, workers: int, rate: float, t: Terms, correction: float) -> float:
        if not t.service:
            return t.kept
        mean = correction * t.service_mean
        a = rate * t.kept * mean  # the refused never queue
        if a >= workers:
            return 0.0
        if t.replay and rate > 0:  # the arrivals as they came, at this rate
            return t.kept * replay_met(t.replay, workers, rate / t.own_rate, correction)
        wait = erlang_c(workers, a)
        theta = (workers - a) / mean / max((self.arrival_cv2 + t.service_cv2) / 2, 1e-3)
        return t.kept * sum(1 - wait * math.exp(-theta * (slo - correction * s))
                            for s, slo in zip(t.service, t.ttft_slo, strict=True)
                            if slo >= correction * s) / len(t.service)

    def prefill_reachable(self, t: Terms, correction: float = 1.0) -> float:
        """The share that meets its TTFT SLO with no wait at all: what any pool size can reach."""
        return t.kept * sum(slo >= correction * s
                            for s, slo in zip(t.service, t.ttft_slo, strict=True)) / max(len(t.service), 1)

    def prefill_workers(self, rate: float, t: Terms, target: float, correction: float = 1.0,
                        limit: int = 100_000, trust: bool = True) -> int:
        """The fewest workers whose predicted TTFT attainment reaches `target` of what is
        reachable at all (requests whose SLO is below their own prefill time never meet it)."""
        if rate <= 0 or not t.service:
            return 1
        reachable = self.prefill_reachable(t, correction)
        goal = min(target * reachable, reachable - REACH_MARGIN)  # never chase the last of what is reachable
        low = self.prefill_keep_up(rate, t, correction)
        return _fewest(_enough(lambda c: self.prefill_attainment(c, rate, t, correction), goal, trust), low, limit)

    @staticmethod
    def prefill_keep_up(rate: float, t: Terms, correction: float = 1.0) -> int:
        """The fewest prefill workers that keep up with the load at all: fewer, and the queue grows."""
        return max(1, math.floor(rate * t.kept * correction * t.service_mean) + 1)

    # ---- decode ---------------------------------------------------------------------------
    def decode_batch(self, workers: int, rate: float, t: Terms, correction: float = 1.0) -> tuple[float, float]:
        """A worker's mean batch and its ITL, at the fixed point of Little's law."""
        itl = correction * self.profile.itl_seconds(1, t.context)
        b = 0.0
        cap = (self.profile.kv_capacity_tokens or 1 << 30) / max(t.kv_tokens, 1.0)
        for _ in range(8):
            b = min(rate * t.kept * t.mean_output * itl / workers, 2 * cap)  # past the KV it diverges: stop there
            itl = correction * self.profile.itl_seconds(max(1, round(b)), t.context)
        return b, itl

    def decode_attainment(self, workers: int, rate: float, t: Terms, correction: float = 1.0) -> float:
        return t.once(("decode", workers, rate, correction, self.hold_s),
                      lambda: self._decode_attainment(workers, rate, t, correction))

    def _decode_attainment(self, workers: float, rate: float, t: Terms, correction: float) -> float:
        """The share of requests whose TPOT meets its SLO. The router sends a sequence to the
        least loaded decode worker, so a request shares its worker only when the pool holds more
        sequences than workers, and then briefly: with N ~ Poisson(b x workers) others in the
        pool (Little's law), it rides with N / workers of them on average over its life. Its
        TPOT is the ITL at that batch plus its KV transfer spread over its output (the first
        decoded token waits for the KV)."""
        if not t.outputs or rate <= 0:
            return t.kept
        b, _ = self.decode_batch(workers, rate, t, correction)
        cap = self.profile.kv_capacity_tokens
        held = b + rate * t.kept * self.hold_s / workers  # decoding, and reserved while prefilling
        if cap and (held + normal_quantile(0.99) * math.sqrt(held)) * t.kv_tokens > cap:
            return 0.0  # the reservations do not fit: requests wait in the router queue
        total = b * workers
        if total > 100:  # the pool's count is about normal: 32 equal-mass points
            pts = [max(0.0, total + normal_quantile((i + 0.5) / 32) * math.sqrt(total)) for i in range(32)]
            return statistics.fmean(self._meets(1.0 + n / workers, t, correction) for n in pts)
        met, mass, n, pn = 0.0, 0.0, 0, math.exp(-total)
        while mass < 0.999 and n < 10_000:
            met += pn * self._meets(1.0 + n / workers, t, correction)
            mass += pn
            n += 1
            pn *= total / n
        return met / max(mass, 1e-12)

    def _meets(self, batch: float, t: Terms, correction: float) -> float:
        """The share of the sample whose TPOT meets its SLO at this (time-averaged) batch: the
        step's cost but for the request's own context's attention, within its room."""
        p = self.profile
        base = p.tokens_cost(batch) + p.sequence_s * batch
        rooms = t.rooms(p, correction)
        points = t.neighbours if batch > 1.0 and t.neighbours else [float(t.context)]
        met = statistics.fmean(len(rooms) - bisect.bisect_left(rooms, base + p.decode_attention_s * (batch - 1) * ctx)
                               for ctx in points)
        return t.kept * (t.single + met) / len(t.outputs)

    def decode_reachable(self, t: Terms, correction: float = 1.0) -> float:
        """The share that meets its TPOT SLO decoding alone: what any pool size can reach."""
        return self._meets(1.0, t, correction) if t.outputs else t.kept

    def decode_workers(self, rate: float, t: Terms, target: float, correction: float = 1.0,
                       limit: int = 100_000, trust: bool = True) -> int:
        """The fewest workers whose predicted TPOT attainment reaches `target` of what a batch of
        one reaches (a short output behind a long KV transfer may miss it however many there are)."""
        if rate <= 0 or not t.outputs:
            return 1
        reachable = self.decode_reachable(t, correction)
        goal = min(target * reachable, reachable - REACH_MARGIN)
        return _fewest(_enough(lambda d: self.decode_attainment(d, rate, t, correction), goal, trust), 1, limit)


NEIGHBOURS = 8


def _weighted_points(values: list[float], weights: list[int], n: int = NEIGHBOURS) -> list[float]:
    """n equally likely values of a weighted distribution: its quantiles at (i + 0.5) / n."""
    if not values:
        return []
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(weights)
    out, acc, i = [], 0.0, 0
    for k in range(n):
        q = (k + 0.5) / n * total
        while i < len(pairs) - 1 and acc + pairs[i][1] < q:
            acc += pairs[i][1]
            i += 1
        out.append(float(pairs[i][0]))
    return out


def _resident_mean(values: list[float], sample: Sequence[Arrival]) -> float:
    """The mean over what sits in a decode batch at a random moment: a request stays for its
    output's steps, so long outputs are there longer, and their contexts and reservations weigh
    by output length (on the Mooncake trace 9% above the plain mean context)."""
    weights = [max(a.output_len, 1) for a in sample]
    return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights) if sample else 1.0


def _enough(attainment, goal: float, trust: bool = True):
    """n workers are enough when they reach the goal, or come within NEAR of it while twice as
    many would add less than DIMINISHING: the requests still missing then are ones more workers
    do not save (a tight SLO behind a long transfer), and a pool grown for them is waste. Only
    while the model is trusted: when observation says it is optimistic, its flat curve is not
    evidence that more workers would not help."""
    def check(n: int) -> bool:
        got = attainment(n)
        if got >= goal:
            return True
        return trust and got >= goal - NEAR and attainment(2 * n) - got < DIMINISHING
    return check


def _fewest(enough, low: int, limit: int) -> int:
    """The smallest n in [low, limit] with enough(n) (monotone: more workers never hurt), else limit."""
    if low >= limit:
        return limit
    hi = low
    while not enough(hi):
        if hi >= limit:
            return limit
        low, hi = hi + 1, min(limit, hi * 2)
    while low < hi:
        mid = (low + hi) // 2
        if enough(mid):
            hi = mid
        else:
            low = mid + 1
    return hi
