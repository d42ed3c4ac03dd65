"""Shared fixtures: the real stories260K checkpoint, random-weight checkpoints of the other
families (built with transformers itself), and transformers' greedy reference output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STORIES = (ROOT.parent / "shared" / "models" / "stories260K").resolve()

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def stories_path() -> str:
    if not (STORIES / "config.json").exists():
        pytest.fail(f"stories260K checkpoint missing at {STORIES}; the suite needs ../shared/models beside the repo")
    return str(STORIES)


def make_random_model(arch: str, path: Path, seed: int = 0, **overrides) -> str:
    """A small random-weight checkpoint of `arch` that reuses stories260K's 512-token tokenizer."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    common.update(overrides)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    cfg = cls[0](**common)
    torch.manual_seed(seed)
    model = cls[1](cfg).to(torch.float32)
    # Larger-than-default init so the random model's next-token distribution is not flat.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / f, path / f)
    return str(path)


@pytest.fixture(scope="session")
def random_models(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("models")
    return {
        "qwen2": make_random_model("qwen2", base / "qwen2", seed=1),
        "qwen3": make_random_model("qwen3", base / "qwen3", seed=2),
        "mistral": make_random_model("mistral", base / "mistral", seed=3, sliding_window=48),
    }


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory, stories_path) -> str:
    """stories260K plus a chat template, so /v1/chat/completions has something to apply."""
    dst = tmp_path_factory.mktemp("chat") / "stories-chat"
    shutil.copytree(stories_path, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg_path.chmod(0o644)
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


_HF_CACHE: dict[str, object] = {}


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    return _HF_CACHE[path]


@torch.inference_mode()
def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, top: int = 5) -> dict:
    """transformers' greedy generate: tokens, and per step the chosen logprob and top-n."""
    model = hf_model(path)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    lps, tops = [], []
    for tok, logits in zip(toks, out.logits, strict=True):
        lp = torch.log_softmax(logits[0].float(), -1)
        lps.append(lp[tok].item())
        v, i = torch.topk(lp, top)
        tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
    return {"token_ids": toks, "logprobs": lps, "top_logprobs": tops}


def check_close(ref: dict, ours: dict, name: str, tol: float = 1e-4) -> None:
    """vLLM's rule: positions agree, or each side's token is in the other's top-5 with a close
    logprob; comparison stops at the first divergence."""
    for pos, (a, b) in enumerate(zip(ref["token_ids"], ours["token_ids"], strict=False)):
        if a == b:
            continue
        ours_top, ref_top = ours["top_logprobs"][pos], ref["top_logprobs"][pos]
        assert a in ours_top and b in ref_top, f"{name}: diverged at {pos}: hf {a} vs ours {b} (not in top-5)"
        assert abs(ref_top[a] - ours_top[a]) < 1e-3 and abs(ref_top[b] - ours_top[b]) < 1e-3, \
            f"{name}: diverged at {pos} with distant logprobs"
        return
    assert len(ours["token_ids"]) == len(ref["token_ids"]), f"{name}: lengths differ"


@pytest.fixture(scope="session")
def story(stories_path) -> list[int]:
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=stories_path))
    ids = eng.tokenize("Once upon a time")
    return ids + eng.generate([ids], SamplingParams(max_tokens=420, temperature=0, ignore_eos=True))[0]["token_ids"]
