"""The step-cost model: how long one engine step takes, from what the step computes.

A step's time is modelled as

    g(T) + a_seq * S + a_prefill * sum(n * (ctx - n / 2)) + a_decode * sum(ctx_d)

- g(T) is the cost of pushing T new tokens through the weights. It is piecewise linear over
  profiled token counts, because it is flat while the step is bandwidth-bound (decode-sized
  batches re-read every weight) and linear once it is compute-bound (long prompts).
- S is the number of sequences in the step: each gets a row of logits (the vocabulary projection)
  and is sampled, which makes a decode batch of B cost more than a B-token prompt.
- The other two terms are attention: a prefill span of n new tokens over ctx context, and one
  decode token over ctx_d cached tokens.

`pdserve profile` measures steps on a real engine and fits the model. Users of the fitted model:
- the scheduling section of the config, to pick a colocated worker's token budget;
- the planner and the simulator, to predict TTFT and ITL.

The file is plain JSON, so the router and the simulator read it without torch.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "pdserve-step-cost/1"


@dataclass(slots=True)
class StepSample:
    """One measured step: prefill spans as (new tokens, context after the step), one context per
    decode sequence, and the step's median wall time in seconds."""

    prefills: list[tuple[int, int]]
    decodes: list[int]
    seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefills) + len(self.decodes)


def _prefill_attention(prefills: list[tuple[int, int]]) -> float:
    # Token i of a span attends ctx - n + i + 1 positions: n * (ctx - n/2) in all, up to rounding.
    return float(sum(n * (ctx - n / 2) for n, ctx in prefills))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares by the normal equations with a tiny ridge (the systems have ~20 unknowns)."""
    k = len(a[0])
    ata = [[sum(r[i] * r[j] for r in a) for j in range(k)] for i in range(k)]
    atb = [sum(r[i] * y for r, y in zip(a, b, strict=True)) for i in range(k)]
    for i in range(k):
        ata[i][i] += 1e-12 * (ata[i][i] or 1.0)
    # Gaussian elimination with partial pivoting.
    m = [row[:] + [atb[i]] for i, row in enumerate(ata)]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if m[c][c] == 0:
            continue
        for r in range(k):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][k] / m[i][i] if m[i][i] else 0.0 for i in range(k)]


@dataclass(slots=True)
class StepCostModel:
    knots: list[int]  # token counts where g is known, ascending
    knot_seconds: list[float]  # g at each knot
    prefill_attention_s: float  # per unit of n * (ctx - n/2)
    decode_attention_s: float  # per cached token read by one decode token
    sequence_s: float = 0.0  # per sequence in the step (its logits and sampling)
    kv_capacity_tokens: int | None = None
    # KV transfer between a prefill and a decode worker: fixed cost + bytes / rate (`pdserve
    # profile --transfer`); kv_bytes_per_token is the model's KV (all layers, K and V).
    transfer_fixed_s: float = 0.0
    transfer_bytes_per_s: float | None = None
    kv_bytes_per_token: int | None = None
    meta: dict = field(default_factory=dict)  # model, threads, machine, engine settings
    samples: list[dict] = field(default_factory=list)  # what the fit came from, with its errors

    # ---- prediction -----------------------------------------------------------------------
    def tokens_cost(self, num_tokens: float) -> float:
        """g(T): linear between knots, and along the last segment's slope beyond them."""
        ks, vs = self.knots, self.knot_seconds
        if len(ks) == 1:
            return vs[0]
        i = min(max(bisect.bisect_right(ks, num_tokens) - 1, 0), len(ks) - 2)
        x0, x1, y0, y1 = ks[i], ks[i + 1], vs[i], vs[i + 1]
        return max(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), 0.0)

    def step_seconds(self, prefills: list[tuple[int, int]] = (), decodes: list[int] = ()) -> float:
        decodes = list(decodes)
        return self.step_seconds_total(list(prefills), len(decodes), sum(decodes))

    def step_seconds_total(self, prefills: list[tuple[int, int]], batch: int, context_sum: int) -> float:
        """The same, with the decodes given as their count and total context (what a simulator
        keeps without walking the batch every step)."""
        tokens = sum(n for n, _ in prefills) + batch
        if tokens == 0:
            return 0.0
        return (self.tokens_cost(tokens) + self.sequence_s * (len(prefills) + batch)
                + self.prefill_attention_s * _prefill_attention(prefills) + self.decode_attention_s * context_sum)

    def prefill_seconds(self, prompt_len: int, cached: int = 0, chunk: int | None = None) -> float:
        """A prompt alone, in chunks of `chunk` new tokens (None: one step); `cached` tokens are
        prefix-cache hits and are not computed."""
        chunk = chunk or max(prompt_len - cached, 1)
        total, done = 0.0, cached
        while done < prompt_len:
            n = min(chunk, prompt_len - done)
            done += n
            total += self.step_seconds([(n, done)])
        return total

    def itl_seconds(self, batch: float, context: int) -> float:
        """A decode step of `batch` sequences that each hold `context` tokens (a fractional batch
        interpolates: the time-averaged batch of a sequence's life)."""
        return self.step_seconds_total([], batch, batch * context)

    def transfer_seconds(self, tokens: int) -> float:
        """Shipping `tokens` tokens' KV; 0 when the profile has no transfer measurement."""
        if not self.transfer_bytes_per_s or not self.kv_bytes_per_token:
            return 0.0
        return self.transfer_fixed_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    @property
    def max_profiled_tokens(self) -> int:
        return self.knots[-1]

    # ---- the token budget -----------------------------------------------------------------
    def choose_budget(self, target_step_s: float, decode_batch: int, decode_context: int,
                      min_efficiency: float = 0.5, cap: int | None = None) -> tuple[int, str]:
        """The largest token budget whose mixed step (a prompt chunk beside `decode_batch` decodes
        at `decode_context`) stays within `target_step_s`, but never so small that prefill runs at
        under `min_efficiency` of its best throughput (prefill must keep up). Returns the budget
        (decode tokens included, as the scheduler counts them) and the reason."""
        cap = cap or 4 * self.max_profiled_tokens
        decodes = [decode_context] * decode_batch

        def mixed(p: int) -> float:
            return self.step_seconds([(p, p)], decodes)

        def throughput(p: int) -> float:
            return p / self.step_seconds([(p, p)])

        chunks = range(16, cap + 1, 16)
        rates = [throughput(p) for p in chunks]
        floor = next(p for p, r in zip(chunks, rates, strict=True) if r >= min_efficiency * max(rates))
        fits = [p for p in chunks if mixed(p) <= target_step_s]
        chunk = max(fits) if fits else 0
        base = f"{decode_batch} decodes at {decode_context} tokens"
        if chunk >= floor:
            why = (f"largest chunk whose step with {base} is predicted within {target_step_s * 1e3:.0f} ms "
                   f"({mixed(chunk) * 1e3:.0f} ms)")
        else:
            why = (f"a step with {base} cannot meet {target_step_s * 1e3:.0f} ms with a chunk that keeps prefill "
                   f"at {min_efficiency:.0%} of its best throughput; using that chunk ({mixed(floor) * 1e3:.0f} ms)")
            chunk = floor
        return chunk + decode_batch, why

    # ---- fitting ----------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: list[StepSample], kv_capacity_tokens: int | None = None,
            meta: dict | None = None) -> StepCostModel:
        if not samples:
            raise ValueError("no step samples to fit")
        knots = sorted({s.num_tokens for s in samples})
        # Which global terms the samples can tell apart from g; each must also come out >= 0
        # (no work costs negative time): a noisy fit that says otherwise drops the term.
        use = {"seq": len({len(s.prefills) + len(s.decodes) for s in samples}) > 1,
               "prefill": any(ctx > 1 for s in samples for _, ctx in s.prefills),
               "decode": any(s.decodes for s in samples)}
        while True:
            model = cls._fit_once(samples, knots, use)
            bad = [k for k, v in (("seq", model.sequence_s), ("prefill", model.prefill_attention_s),
                                  ("decode", model.decode_attention_s)) if use[k] and v < 0]
            if not bad:
                break
            use[bad[0]] = False
        # Pushing more tokens through the weights never takes less time.
        for i in range(1, len(model.knot_seconds)):
            model.knot_seconds[i] = max(model.knot_seconds[i], model.knot_seconds[i - 1])
        model.kv_capacity_tokens = kv_capacity_tokens
        model.meta = dict(meta or {})
        model.samples = model.scored(samples)
        return model

    def scored(self, samples: list[StepSample]) -> list[dict]:
        """Each sample as a plain dict beside the step time this model predicts for it."""
        return [{**asdict(s), "predicted": self.step_seconds(s.prefills, s.decodes)} for s in samples]

    @classmethod
    def _fit_once(cls, samples: list[StepSample], knots: list[int], use: dict[str, bool]) -> StepCostModel:
        rows, ys = [], []
        for s in samples:
            row = [0.0] * len(knots)
            row[knots.index(s.num_tokens)] = 1.0  # every sample's token count is a knot: g there is one unknown
            row += [float(len(s.prefills) + len(s.decodes))] if use["seq"] else []
            row += [_prefill_attention(s.prefills)] if use["prefill"] else []
            row += [float(sum(s.decodes))] if use["decode"] else []
            rows.append(row)
            ys.append(s.seconds)
        # Relative errors count, not absolute ones: step times span 1 ms to 1 s, and an absolute fit
        # would spend itself on the longest prompts. Each row is divided by its measured time.
        rows = [[v / y for v in r] for r, y in zip(rows, ys, strict=True)]
        ys = [1.0] * len(ys)
        # Scale columns to similar magnitudes before solving (attention features are ~1e6).
        scale = [max(max(abs(r[j]) for r in rows), 1e-30) for j in range(len(rows[0]))]
        x = _solve([[v / sc for v, sc in zip(r, scale, strict=True)] for r in rows], ys)
        x = [v / sc for v, sc in zip(x, scale, strict=True)]
        g = x[:len(knots)]
        extra = x[len(knots):]
        a_s = extra.pop(0) if use["seq"] else 0.0
        a_p = extra.pop(0) if use["prefill"] else 0.0
        a_d = extra.pop(0) if use["decode"] else 0.0
        return cls(list(knots), g, a_p, a_d, a_s)

    def fit_error(self) -> float:
        """Median relative error of the fit on its own samples."""
        errs = sorted(abs(s["predicted"] - s["seconds"]) / s["seconds"] for s in self.samples if s["seconds"] > 0)
        return errs[len(errs) // 2] if errs else math.nan

    # ---- the file -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read step-cost profile {p}: {e}") from e
        if data.get("format") != FORMAT:
            raise ValueError(f"{p} is not a step-cost profile (format {data.get('format')!r}, expected {FORMAT!r}); "
                             "make one with `pdserve profile`")
        data.pop("format")
        model = cls(**data)
        if not model.knots or len(model.knots) != len(model.knot_seconds):
            raise ValueError(f"{p}: knots and knot_seconds must be non-empty and of equal length")
        return model
