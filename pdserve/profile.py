"""`pdserve profile`: measure one worker's engine step by step and fit the step-cost model.

It runs the pool's own engine configuration in this process (same model, dtype, threads and KV
pool) and times single steps through the engine's public API:
- prefill steps of n tokens, as one prompt and as four prompts of n/4 (the two separate the
  weights' cost from attention's);
- decode steps of batch B at a short and a long context;
- mixed steps (a prompt beside a decode batch), held out of the fit to check its predictions.

The result is a JSON file (pdcommon.step_cost) and a PNG of measured against predicted times.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from pathlib import Path

from pdcommon.step_cost import StepCostModel, StepSample


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Distinct random ids: no prefix hits, no early stops that matter (max_tokens bounds the run).
    return [rng.randrange(3, vocab) for _ in range(n)]


def _timed_step(eng, expect: int) -> float:
    t0 = time.perf_counter()
    outs = eng.step()
    dt = time.perf_counter() - t0
    if len(outs) != expect:  # the step did not compute what was asked: the budget split it
        raise RuntimeError(f"profiling step produced {len(outs)} outputs, expected {expect}")
    return dt


def _drain(eng) -> None:
    while eng.has_unfinished():
        eng.step()


def _start_decoders(eng, rng, sp, batch: int, context: int, new: int, budget: int) -> None:
    """`batch` sequences at `context` tokens, stepped until every one is decoding. Those prefilled
    first decode while the rest prefill, so each gets that many more tokens to go."""
    vocab = eng.spec.vocab_size
    new += -(-batch * context // budget) + 1
    for _ in range(batch):
        eng.add_request(None, _prompt(rng, context, vocab), sp(max_tokens=new, temperature=0, ignore_eos=True))
    started = 0
    while started < batch:
        started += sum(1 for o in eng.step() if o.num_output_tokens == 1)


def measure_prefill(eng, n: int, parts: int, repeats: int, rng: random.Random) -> StepSample:
    from engine import SamplingParams

    size = n // parts
    times = []
    for _ in range(repeats):
        for _ in range(parts):
            eng.add_request(None, _prompt(rng, size, eng.spec.vocab_size), SamplingParams(max_tokens=1, temperature=0))
        times.append(_timed_step(eng, parts))
        _drain(eng)
    return StepSample([(size, size)] * parts, [], statistics.median(times))


def measure_prefix_hit(eng, n: int, hit: int, repeats: int, rng: random.Random) -> StepSample:
    """A prompt of `n` tokens whose first `hit` are prefix-cache hits: the step computes the
    other n - hit against the whole context (a real hit: the same leading tokens were computed
    just before and stay cached)."""
    from engine import SamplingParams

    sp, vocab = SamplingParams(max_tokens=1, temperature=0), eng.spec.vocab_size
    times = []
    for _ in range(repeats):
        base = _prompt(rng, n, vocab)
        eng.add_request(None, base, sp)
        _drain(eng)  # computed once; its full blocks stay in the prefix cache
        eng.add_request(None, base[:hit] + _prompt(rng, n - hit, vocab), sp)
        t0 = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t0)
        if len(outs) != 1 or outs[0].num_cached_tokens != hit:
            got = outs[0].num_cached_tokens if outs else None
            raise RuntimeError(f"prefix-hit step: expected {hit} cached tokens, the engine found {got}")
        _drain(eng)
    return StepSample([(n - hit, n)], [], statistics.median(times))


def measure_decode(eng, batch: int, context: int, steps: int, rng: random.Random,
                   prompt: int = 0) -> StepSample:
    """Decode steps of `batch` sequences at `context`; with `prompt`, one more prompt of that many
    tokens shares the first timed step (a mixed step)."""
    from engine import SamplingParams

    _start_decoders(eng, rng, SamplingParams, batch, context, steps + 2, eng.config.max_num_batched_tokens)
    if prompt:
        eng.add_request(None, _prompt(rng, prompt, eng.spec.vocab_size), SamplingParams(max_tokens=1, temperature=0))
        times = [_timed_step(eng, batch + 1)]
    else:
        times = [_timed_step(eng, batch) for _ in range(steps)]
    _drain(eng)
    # Contexts grow by one per step: the sample carries their mean.
    ctx = context + 1 + (len(times) - 1) // 2
    return StepSample([(prompt, prompt)] if prompt else [], [ctx] * batch, statistics.median(times))


def _powers(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


def run_profile(engine_config, max_prompt: int = 2048, max_batch: int = 64, repeats: int = 3, steps: int = 8,
                log=print) -> StepCostModel:
    """Profile an engine built from `engine_config` (the pool's own settings; only the token budget
    and the batch cap are widened so that each measured step is what was asked; prompts are random,
    so prefix hits happen only where the hit sweep makes them)."""
    import dataclasses

    import torch

    from engine import LLMEngine

    limit = engine_config.max_model_len
    cfg = dataclasses.replace(engine_config, max_num_batched_tokens=max(max_prompt, max_batch) + 64,
                              prefill_chunk_size=None,
                              max_num_seqs=max(engine_config.max_num_seqs, max_batch + 1))
    eng = LLMEngine(cfg)
    spec, stats = eng.spec, eng.stats()
    capacity = stats.num_blocks * cfg.block_size
    max_len = min(eng.max_model_len, limit or eng.max_model_len)
    rng = random.Random(0)
    max_prompt = min(max_prompt, max_len - 1, capacity // 2)
    t0 = time.perf_counter()
    samples, hits = _prefill_samples(eng, cfg, max_prompt, repeats, rng, log)
    contexts = sorted({min(32, max_len // 4), min(512, max_len * 3 // 4)})
    for context in contexts:
        for b in _powers(1, max_batch):
            if b * (context + steps + 2) > capacity:
                log(f"  decode batch {b} at {context} tokens: skipped, needs more KV than the pool's {capacity} tokens")
                continue
            samples.append(measure_decode(eng, b, context, steps, rng))
            log(f"  decode batch {b:3d} at {context:5d} tokens: {samples[-1].seconds * 1e3:8.2f} ms")
    checks = []
    for b, p in ((8, min(256, max_prompt)), (4, min(512, max_prompt))):
        if b * (contexts[-1] + steps + 2) + p <= capacity:
            # A mixed step is one step of its run: one timing moved with the host's speed (a
            # 512-token prompt beside 4 decodes once took 272 ms where a prompt alone took 175).
            runs = [measure_decode(eng, b, contexts[-1], steps, rng, prompt=p) for _ in range(repeats)]
            checks.append(dataclasses.replace(runs[0], seconds=statistics.median(r.seconds for r in runs)))
    meta = _meta(eng, cfg, torch.get_num_threads(), torch.__version__, time.perf_counter() - t0)
    model = StepCostModel.fit(samples, kv_capacity_tokens=capacity, meta=meta)
    model.meta["held_out"] = model.scored(checks)
    model.meta["prefix_hits"] = model.scored(hits)  # in the fit: how well it carries the hit fraction
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    model.kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize
    return model


def _prefill_samples(eng, cfg, max_prompt: int, repeats: int, rng: random.Random, log,
                     ) -> tuple[list[StepSample], list[StepSample]]:
    """Prefill steps by prompt length (one prompt, and four sharing the step), then prefix hits;
    returns (all samples, the hit samples among them)."""
    measure_prefill(eng, min(64, max_prompt), 1, 1, rng)  # warm-up: first calls allocate and pick kernels
    samples: list[StepSample] = []
    for n in _powers(16, max_prompt):
        for parts in (1, 4) if n >= 256 else (1,):
            samples.append(measure_prefill(eng, n, parts, repeats, rng))
            log(f"  prefill {parts} x {n // parts:5d} tokens: {samples[-1].seconds * 1e3:8.1f} ms")
    # Prefix hits: the prompt's hit fraction is an input of the model (the cached part is not
    # computed, but the rest attends to it). At the longest prompt, half, 3/4 and 7/8 cached, so
    # the computed part is a token count already measured alone and the difference is context.
    hits = []
    n = _powers(16, max_prompt)[-1]
    if cfg.enable_prefix_caching:
        for new in (n // 2, n // 4, n // 8):
            if new < 16 or new % cfg.block_size:
                continue
            hits.append(measure_prefix_hit(eng, n, n - new, repeats, rng))
            log(f"  prefill {n:5d} tokens, {n - new:5d} cached: {hits[-1].seconds * 1e3:8.1f} ms")
    return samples + hits, hits


def _meta(eng, cfg, threads: int, torch_version: str, seconds: float) -> dict:
    spec = eng.spec
    return {"model": cfg.model, "architecture": spec.architecture, "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers, "vocab_size": spec.vocab_size, "dtype": cfg.dtype,
            "device": cfg.device, "block_size": cfg.block_size, "threads": threads,
            # The GEMM layout the steps ran with: on the AMD host MKL's decode batches were half
            # as fast, so a profile measured with one layout misleads a planner serving the other.
            "cpu_gemm": eng.gemm_layout, "gemm_routes": eng.gemm_routes,
            "cpu": platform.processor() or platform.machine(), "torch": torch_version,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "profile_seconds": round(seconds, 1)}


def add_transfer(model: StepCostModel, transport: str, log=print) -> None:
    """Measure KV transfer time against bytes over `transport` and store its fit in the model."""
    from pdserve.profile_transfer import measure_transfer

    got = measure_transfer(transport, model.kv_bytes_per_token, model.meta.get("block_size", 16))
    for row in got["points"]:
        log(f"  transfer {row['tokens']:5d} tokens ({row['bytes'] / 2**20:7.1f} MiB): {row['seconds'] * 1e3:8.2f} ms")
    model.transfer_fixed_s, model.transfer_bytes_per_s = got["fixed_s"], got["bytes_per_s"]
    model.meta["transfer"] = got


def plot(model: StepCostModel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    pf = [s for s in model.samples if s["prefills"] and not s["decodes"]]
    hit = [s for s in pf if any(ctx > n for n, ctx in s["prefills"])]  # the prefix-hit sweep
    pf = [s for s in pf if s not in hit]
    for parts in sorted({len(s["prefills"]) for s in pf}):
        pts = sorted(((sum(n for n, _ in s["prefills"]), s) for s in pf if len(s["prefills"]) == parts),
                     key=lambda p: p[0])
        ax1.plot([t for t, _ in pts], [s["seconds"] * 1e3 for _, s in pts], "o", label=f"measured, {parts} prompt(s)")
        ax1.plot([t for t, _ in pts], [s["predicted"] * 1e3 for _, s in pts], "-", alpha=0.6)
    if hit:
        ctx = hit[0]["prefills"][0][1]
        ax1.plot([s["prefills"][0][0] for s in hit], [s["seconds"] * 1e3 for s in hit], "x", ms=8,
                 label=f"measured, after a prefix hit ({ctx}-token prompt)")
        ax1.plot([s["prefills"][0][0] for s in hit], [s["predicted"] * 1e3 for s in hit], "+", ms=10,
                 label="predicted, after a prefix hit")
    ax1.set(xscale="log", yscale="log", xlabel="prefill tokens in the step", ylabel="step time (ms)",
            title="prefill step")
    ax1.legend(fontsize=8)
    dec = [s for s in model.samples if s["decodes"] and not s["prefills"]]
    for ctx in sorted({s["decodes"][0] // 64 for s in dec}):
        pts = sorted((len(s["decodes"]), s) for s in dec if s["decodes"][0] // 64 == ctx)
        label = f"context ~{pts[0][1]['decodes'][0]}"
        ax2.plot([b for b, _ in pts], [s["seconds"] * 1e3 for _, s in pts], "o", label=f"measured, {label}")
        ax2.plot([b for b, _ in pts], [s["predicted"] * 1e3 for _, s in pts], "-", alpha=0.6)
    ax2.set(xscale="log", xlabel="decode batch", ylabel="step time (ms)", title="decode step (ITL)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{Path(model.meta.get('model', '?')).name}, {model.meta.get('threads')} thread(s): "
                 f"fit error (median) {model.fit_error():.1%}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(model: StepCostModel) -> str:
    held = model.meta.get("held_out", [])
    errs = [abs(h["predicted"] - h["seconds"]) / h["seconds"] for h in held]
    lines = [f"fit: median error {model.fit_error():.1%} on {len(model.samples)} steps"
             + (f"; held-out mixed steps: {', '.join(f'{e:.0%}' for e in errs)}" if errs else ""),
             f"prefill 512 tokens: {model.prefill_seconds(512) * 1e3:.1f} ms; ITL batch 1 / 8 at 512: "
             f"{model.itl_seconds(1, 512) * 1e3:.1f} / {model.itl_seconds(8, 512) * 1e3:.1f} ms; "
             f"KV capacity {model.kv_capacity_tokens} tokens"]
    if model.transfer_bytes_per_s:
        lines.append(f"KV transfer: {model.transfer_fixed_s * 1e3:.2f} ms + "
                     f"{model.transfer_bytes_per_s / 1e9:.2f} GB/s "
                     f"({model.kv_bytes_per_token} bytes per token; 2048 tokens: "
                     f"{model.transfer_seconds(2048) * 1e3:.1f} ms)")
    return "\n".join(lines)
