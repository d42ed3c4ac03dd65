"""The engine on an accelerator (or any torch device): does it still match transformers token for
token there, does a KV export/import between two engines on it work, and how fast are its
prefill and decode against transformers on the same device?

CI has no accelerator, so the test suite proves all of this on the CPU only. This is the check
to run where one is lent (`python bench/device_check.py --device cuda --model PATH`);
`--device cpu` runs the same checks here. Each check records its error and the run goes on, so
one broken path does not hide the others. JSON out (default bench/out/device_check.json); the
exit status is 1 when a parity check fails.

Parity is checked in float32 with TF32 off (the engine's batched kernels and transformers' are
then close enough for greedy tokens to agree); bfloat16 is reported with vLLM's rule (agree, or
diverge only where each side's token is in the other's top-5), since there the two stacks round
differently and a near-tie may go either way.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after ROOT: bench/engine.py would shadow the engine package

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

LENGTHS = [1, 5, 17, 100, 250, 480]
NEW = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_model(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], new: int, device: str) -> dict:
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    toks = out.sequences[0, len(ids):].tolist()
    tops = []
    for logits in out.logits:
        lp = torch.log_softmax(logits[0].float(), -1)
        v, i = torch.topk(lp, 5)
        tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
    return {"token_ids": toks, "top": tops}


def compare(ref: dict, ours: dict) -> dict:
    """Exact agreement, and where they first differ whether each token is in the other's top-5."""
    for pos, (a, b) in enumerate(zip(ref["token_ids"], ours["token_ids"], strict=False)):
        if a != b:
            near = a in ours["top"][pos] and b in ref["top"][pos]
            return {"exact": False, "diverged_at": pos, "near_tie": near}
    same_len = len(ref["token_ids"]) == len(ours["token_ids"])
    return {"exact": same_len, "diverged_at": None if same_len else min(map(len, (ref["token_ids"],
                                                                                   ours["token_ids"]))),
            "near_tie": False}


def ours_dict(out: dict) -> dict:
    return {"token_ids": out["token_ids"], "top": [{int(k): v for k, v in t.items()} for t in out["top_logprobs"]]}


def story(model_path: str, device: str) -> list[int]:
    eng = LLMEngine(EngineConfig(model=model_path, device=device))
    ids = eng.tokenize("Once upon a time")
    out = eng.generate([ids], SamplingParams(max_tokens=500 - len(ids), temperature=0, ignore_eos=True))[0]
    return ids + out["token_ids"]


def check_parity(model_path: str, device: str, dtype: str, ids: list[int]) -> dict:
    """One batch of prompts of mixed lengths through the engine, under three block/chunk shapes."""
    hf = hf_model(model_path, device, dtype)
    refs = {n: hf_greedy(hf, ids[:n], NEW, device) for n in LENGTHS}
    rows = []
    for block_size, chunk in [(16, None), (1, 7), (16, 64)]:
        eng = LLMEngine(EngineConfig(model=model_path, device=device, dtype=dtype, block_size=block_size,
                                     prefill_chunk_size=chunk, max_num_batched_tokens=512))
        outs = eng.generate([ids[:n] for n in LENGTHS],
                            SamplingParams(max_tokens=NEW, temperature=0, logprobs=5))
        for n, out in zip(LENGTHS, outs, strict=True):
            rows.append({"block_size": block_size, "chunk": chunk, "prompt": n,
                         **compare(refs[n], ours_dict(out))})
        rows[-1]["blocks_left"] = eng.stats().used_blocks
    return summarize(rows)


def check_transfer(model_path: str, device: str, ids: list[int]) -> dict:
    """The prefill/decode split in miniature on the device: a prefill-only engine exports the
    blocks (staged through host memory), a second engine lands them and decodes; the tokens must
    equal one engine's."""
    cfg = EngineConfig(model=model_path, device=device, block_size=16, max_num_batched_tokens=256)
    pre, dec, one = LLMEngine(cfg), LLMEngine(cfg), LLMEngine(cfg)
    params = SamplingParams(max_tokens=NEW, temperature=0, logprobs=5)
    lens = [5, 33, 250, 480]
    want = {n: o["token_ids"] for n, o in zip(lens, one.generate([ids[:n] for n in lens], params), strict=True)}
    got: dict[str, list[int]] = {}
    for n in lens:
        pre.add_request(f"r{n}", ids[:n], params, prefill_only=True)
    while pre.has_unfinished():
        for out in pre.step():
            got[out.request_id] = list(out.new_token_ids)
    shipped = 0
    for n in lens:
        rid = f"r{n}"
        res = dec.reserve_import(rid, ids[:n], params)
        exp = pre.export_kv(rid, skip_blocks=res.num_held_blocks, max_frame_bytes=3 * res.layout.block_nbytes)
        offset = 0
        for frame, k in zip(exp.frames, exp.blocks_per_frame, strict=True):
            dec.land_kv(res, offset, bytes(frame))
            offset += k
            shipped += memoryview(frame).nbytes
        pre.release(rid)
        dec.commit_import(rid, exp.first_token, exp.first_logprob)
    while dec.has_unfinished():
        for out in dec.step():
            got[out.request_id] += out.new_token_ids
    ok = all(got[f"r{n}"] == want[n] for n in lens)
    return {"ok": ok, "bytes_shipped": shipped, "blocks_left": [pre.stats().used_blocks, dec.stats().used_blocks]}


def summarize(rows: list[dict]) -> dict:
    exact = sum(r["exact"] for r in rows)
    close = sum(r["exact"] or r["near_tie"] for r in rows)
    return {"cases": len(rows), "exact": exact, "exact_or_near_tie": close, "rows": rows}


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def check_speed(device: str, dtype: str, overrides: dict, lengths: list[int], batches: list[int]) -> dict:
    """Prefill seconds per prompt and decode tokens/s against transformers on the same device."""
    from model_factory import BENCH_LLAMA, build_bench_model, random_prompt

    spec = {**BENCH_LLAMA, **overrides}
    name = "llama-" + "-".join(f"{k[:3]}{v}" for k, v in sorted(overrides.items())) if overrides else "llama-50m"
    path = str(build_bench_model(ROOT / "bench" / "out" / name, **overrides))
    hf = hf_model(path, device, dtype)
    eng = LLMEngine(EngineConfig(model=path, device=device, dtype=dtype, max_num_batched_tokens=4096,
                                 max_num_seqs=max(batches), enable_prefix_caching=False,
                                 kv_cache_memory_bytes=4 << 30))
    res: dict = {"model": spec, "prefill": {}, "decode": {}}
    greedy1 = SamplingParams(max_tokens=1, temperature=0)

    def ours_prefill(n: int, seed: int) -> None:
        eng.generate([random_prompt(n, seed=seed)], greedy1)

    def hf_prefill(n: int, seed: int) -> None:
        with torch.inference_mode():
            hf(torch.tensor([random_prompt(n, seed=seed)], device=device), logits_to_keep=1)

    for n in lengths:
        for s in range(2):  # warm-up (allocator, kernels)
            ours_prefill(n, 90 + s)
            hf_prefill(n, 90 + s)
        ours = min(timed(lambda s=s, n=n: ours_prefill(n, 100 + s), device) for s in range(5))
        ref = min(timed(lambda s=s, n=n: hf_prefill(n, 100 + s), device) for s in range(5))
        res["prefill"][n] = {"ours_ms": ours * 1e3, "hf_ms": ref * 1e3, "vs_hf": ref / ours}
    new = 64

    def best(fn) -> float:
        return min(timed(fn, device) for _ in range(2))

    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    for b in batches:
        prompts = [random_prompt(512, seed=1000 * b + i) for i in range(b)]
        ids = torch.tensor(prompts, device=device)

        def ours_gen(k: int, prompts=prompts) -> None:
            eng.generate(prompts, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))

        def hf_gen(k: int, ids=ids) -> None:
            with torch.inference_mode():
                hf.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)

        # Each side's `new` tokens less its first (the prefill), best of two: the decode steps.
        ours_gen(new)
        hf_gen(2)
        t_ours = best(lambda: ours_gen(new)) - best(lambda: ours_gen(1))
        t_hf = best(lambda: hf_gen(new)) - best(lambda: hf_gen(1))
        tps, hf_tps = b * (new - 1) / t_ours, b * (new - 1) / t_hf
        res["decode"][b] = {"ours_tok_s": tps, "hf_tok_s": hf_tps, "vs_hf": tps / hf_tps,
                            "ours_step_ms": t_ours / (new - 1) * 1e3}
    res["decode_profile"] = {b: profile_decode(eng, device, b) for b in (batches[0], batches[-1])}
    return res


def profile_decode(eng: LLMEngine, device: str, batch: int, steps: int = 8) -> dict:
    """Where a decode step's time goes (torch.profiler over `steps` steps of `batch` sequences):
    wall time, how much of it the device computed, kernels launched, and the top ops by host
    time and by device time. A step far longer than its device time is launch-bound."""
    from model_factory import random_prompt
    from torch.profiler import ProfilerActivity, profile

    for i in range(batch):
        eng.add_request(None, random_prompt(512, seed=7000 + i),
                        SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
    for _ in range(3):  # the prefill steps and a first decode step, unprofiled
        eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        wall = timed(lambda: [eng.step() for _ in range(steps)], device)
    while eng.has_unfinished():
        eng.step()

    def dev_us(e) -> float:
        return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)

    events = prof.key_averages()
    kernels = [e for e in events if dev_us(e) > 0]

    def row(e, key: float) -> dict:
        return {"op": e.key[:80], "ms_per_step": key / 1e3 / steps, "calls_per_step": e.count / steps}

    return {"step_ms": wall / steps * 1e3,
            "device_busy_ms_per_step": sum(dev_us(e) for e in kernels) / 1e3 / steps,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "aten_calls_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
            "top_host": [row(e, e.self_cpu_time_total) for e in
                         sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]],
            "top_device": [row(e, dev_us(e)) for e in sorted(kernels, key=dev_us, reverse=True)[:8]]}


def run(name: str, fn, out: dict) -> None:
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded, and the other checks still run
        out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    out[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{name}: {json.dumps({k: v for k, v in out[name].items() if k != 'rows'})[:600]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "stories260K"))
    ap.add_argument("--speed", default="50m,1b", help="benchmark models to time: 50m, 1b (comma list; '' for none)")
    ap.add_argument("--no-parity", action="store_true", help="speed (and its profile) only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "device_check.json"))
    args = ap.parse_args()
    dev = args.device
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity needs real float32 products
    torch.backends.cudnn.allow_tf32 = False
    out: dict = {"device": dev, "torch": torch.__version__, "host": platform.node(),
                 "device_name": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else platform.processor()}
    ids: list[int] = []
    run("engine_loads", lambda: {"story_tokens": len(ids.extend(story(args.model, dev)) or ids)}, out)
    if not args.no_parity:
        run("parity_float32", lambda: check_parity(args.model, dev, "float32", ids), out)
        run("parity_bfloat16", lambda: check_parity(args.model, dev, "bfloat16", ids), out)
        run("kv_export_import", lambda: check_transfer(args.model, dev, ids), out)
    big = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=8)
    speed_dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    for which in filter(None, args.speed.split(",")):
        overrides = big if which == "1b" else {}
        batches = [1, 8, 32, 128] if dev.startswith("cuda") else [1, 8]
        lengths = [512, 2048] if dev.startswith("cuda") else [128, 512]
        run(f"speed_{which}", lambda o=overrides, b=batches, n=lengths: check_speed(dev, speed_dtype, o, n, b), out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    bad = [k for k in ("parity_float32", "kv_export_import") if k in out and
           ("error" in out[k] or not out[k].get("ok", out[k].get("exact") == out[k].get("cases")))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
