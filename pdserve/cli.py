"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog was sad because"]


def cmd_demo(args: argparse.Namespace) -> int:
    """Stream a few prompts through the engine and print each answer with its timings."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads))
    print(f"model: {args.model}  ({eng.spec.architecture}, {eng.kv.num_blocks} KV blocks)\n")
    for prompt in DEMO_PROMPTS:
        t0 = time.perf_counter()
        eng.add_request(None, prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0))
        print(f"> {prompt}", end="", flush=True)
        first = last = None
        n = 0
        while eng.has_unfinished():
            for out in eng.step():
                now = time.perf_counter()
                first = first or now
                last, n = now, n + len(out.new_token_ids)
                print(out.text_delta, end="", flush=True)
        ttft = (first - t0) * 1e3
        tpot = (last - first) * 1e3 / max(n - 1, 1)
        print(f"\n  [{n} tokens, TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="generate a few stories on the local engine")
    demo.add_argument("--model", default="../shared/models/stories260K")
    demo.add_argument("--max-tokens", type=int, default=60)
    demo.add_argument("--threads", type=int, default=None)
    demo.set_defaults(func=cmd_demo)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
