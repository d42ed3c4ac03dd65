"""Engine throughput against transformers and against this machine's ceilings, in one run.

Writes bench/out/engine.json with keys `prefill`, `decode`, `ceilings` (see issue 2).
Run: .venv/bin/python bench/engine.py [--quick]. It re-executes itself with tcmalloc preloaded
when Debian's libtcmalloc-minimal4 is installed (both engines then share the allocator).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
OUT = Path(__file__).resolve().parent / "out"


def maybe_reexec_with_tcmalloc(args) -> None:
    if args.no_tcmalloc or "LD_PRELOAD" in os.environ or not Path(TCMALLOC).exists():
        return
    env = dict(os.environ, LD_PRELOAD=TCMALLOC)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_ceilings() -> dict:
    import torch

    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t = best_time(lambda: torch.mm(a, b), 5)
    gemm = 2 * n**3 / t
    x = torch.ones(256 * 1024 * 1024 // 4)  # 256 MiB: far beyond any cache
    x.sum()
    t = best_time(lambda: x.sum(), 7)
    return {"gemm_flops": gemm, "mem_read_bytes_per_s": x.nbytes / t}


def model_numbers(spec) -> dict:
    h, inter, layers = spec.hidden_size, spec.intermediate_size, spec.num_layers
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    body = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h) + h
    return {"body_params": body, "lm_head_params": spec.vocab_size * h}


def prefill_flops(spec, nums, n: int) -> float:
    return 2 * nums["body_params"] * n + 2 * nums["lm_head_params"] + \
        2 * spec.num_layers * spec.num_heads * spec.head_dim * n * n


def bench_prefill_ours(eng, lengths, repeat) -> dict[int, float]:
    from model_factory import random_prompt

    from engine import SamplingParams

    res = {}
    for n in lengths:
        prompts = [random_prompt(n, seed=100 + r) for r in range(repeat + 1)]

        def run(p=prompts):
            run.i = getattr(run, "i", -1) + 1
            eng.add_request(None, p[run.i], SamplingParams(max_tokens=1, temperature=0))
            while eng.has_unfinished():
                eng.step()
        run()  # warm-up
        res[n] = n / best_time(run, repeat)
    return res


def bench_prefill_hf(model, lengths, repeat) -> dict[int, float]:
    import torch
    from model_factory import random_prompt

    res = {}
    for n in lengths:
        ids = torch.tensor([random_prompt(n, seed=100)])
        with torch.inference_mode():
            model(ids, logits_to_keep=1)
            t = best_time(lambda ids=ids: model(ids, logits_to_keep=1), repeat)
        res[n] = n / t
    return res


def bench_decode_ours(eng, batches, prompt_len, new) -> dict[int, float]:
    from model_factory import random_prompt

    from engine import SamplingParams

    res = {}
    for b in batches:
        for i in range(b):
            eng.add_request(None, random_prompt(prompt_len, seed=1000 * b + i),
                            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        first = last = None
        count = 0
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.num_output_tokens == 1:
                    first = first or now  # all first tokens come from one prefill step... or few
                    continue
                count += len(o.new_token_ids)
            if first is not None and count:
                last = now
        res[b] = count / (last - first)
    return res


def bench_decode_hf(model, batches, prompt_len, new) -> dict[int, float]:
    import torch
    from model_factory import random_prompt

    res = {}
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    for b in batches:
        ids = torch.tensor([random_prompt(prompt_len, seed=1000 * b + i) for i in range(b)])
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
            t_one = best_time(lambda ids=ids: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), 2)
            t_all = best_time(lambda ids=ids: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw), 1)
        res[b] = b * (new - 1) / (t_all - t_one)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller decode batch set")
    ap.add_argument("--no-tcmalloc", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(OUT / "engine.json"))
    args = ap.parse_args()
    maybe_reexec_with_tcmalloc(args)

    import torch
    from model_factory import build_bench_model
    from transformers import AutoModelForCausalLM

    from engine import EngineConfig, LLMEngine

    torch.set_num_threads(args.threads)
    path = build_bench_model()
    repeat = 2 if args.quick else 4
    lengths = [128, 512, 2048]
    batches = [1, 8, 32]
    ceil = measure_ceilings()
    print(f"ceilings: GEMM {ceil['gemm_flops'] / 1e9:.1f} GFLOP/s, read {ceil['mem_read_bytes_per_s'] / 1e9:.2f} GB/s")

    eng = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=4096, max_num_seqs=64,
                                 enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30,
                                 num_threads=args.threads))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    spec = eng.spec
    nums = model_numbers(spec)
    # The machine is shared and noisy: alternate ours and transformers' runs, keep each one's best.
    ours_pf, hf_pf, ours_dec, hf_dec = {}, {}, {}, {}
    for _ in range(repeat):
        for d, new in ((ours_pf, bench_prefill_ours(eng, lengths, 2)), (hf_pf, bench_prefill_hf(hf, lengths, 2))):
            for k, v in new.items():
                d[k] = max(d.get(k, 0.0), v)
    for _ in range(2 if args.quick else 3):
        for d, new in ((ours_dec, bench_decode_ours(eng, batches, 128, 128)),
                       (hf_dec, bench_decode_hf(hf, batches, 128, 128))):
            for k, v in new.items():
                d[k] = max(d.get(k, 0.0), v)

    elem = 4
    weight_bytes = (nums["body_params"] + nums["lm_head_params"]) * elem
    kv_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * elem
    result = {"model": {"path": str(path), **nums, "dtype": "float32"}, "threads": args.threads,
              "tcmalloc": "tcmalloc" in os.environ.get("LD_PRELOAD", ""), "ceilings": ceil,
              "cpu_gemm": eng.gemm_layout, "gemm_routes": eng.gemm_routes,
              "prefill": [], "decode": []}
    for n in lengths:
        achieved = prefill_flops(spec, nums, n) * ours_pf[n] / n
        result["prefill"].append({"prompt_len": n, "tokens_per_s": ours_pf[n], "hf_tokens_per_s": hf_pf[n],
                                  "vs_hf": ours_pf[n] / hf_pf[n], "flops_per_s": achieved,
                                  "ceiling_fraction": achieved / ceil["gemm_flops"]})
    for b in batches:
        avg_ctx = 128 + 64  # mean context over the 128 generated tokens
        bytes_step = weight_bytes + b * avg_ctx * kv_per_token
        achieved = bytes_step * ours_dec[b] / b
        result["decode"].append({"batch": b, "tokens_per_s": ours_dec[b], "hf_tokens_per_s": hf_dec[b],
                                 "vs_hf": ours_dec[b] / hf_dec[b], "bytes_per_s": achieved,
                                 "ceiling_fraction": achieved / ceil["mem_read_bytes_per_s"]})
    result["decode_batch32_over_batch1"] = ours_dec[32] / ours_dec[1]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for r in result["prefill"]:
        print(f"prefill {r['prompt_len']:5d}: ours {r['tokens_per_s']:9.0f} tok/s  hf {r['hf_tokens_per_s']:9.0f}  "
              f"x{r['vs_hf']:.2f}  {100 * r['ceiling_fraction']:.0f}% of GEMM ceiling")
    for r in result["decode"]:
        print(f"decode batch {r['batch']:2d}: ours {r['tokens_per_s']:8.1f} tok/s  hf {r['hf_tokens_per_s']:8.1f}  "
              f"x{r['vs_hf']:.2f}  {100 * r['ceiling_fraction']:.0f}% of bandwidth ceiling")
    print(f"decode batch 32 / batch 1: {result['decode_batch32_over_batch1']:.1f}x   -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
