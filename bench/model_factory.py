"""The benchmark model: a 50M-parameter random-weight Llama written as a Hugging Face folder
(fixed seed, offline-built 32000-token tokenizer), so pdserve and any other server can load it."""

from __future__ import annotations

import json
from pathlib import Path

BENCH_LLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
DEFAULT_DIR = Path(__file__).resolve().parent / "out" / "llama-50m"


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer over pseudo-words: a real tokenizer.json, built without any download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: list[str] = []
    i = 0
    while len(words) < vocab_size - len(specials):
        n, w = i, ""
        while True:
            w += letters[n % 26]
            n //= 26
            if n == 0:
                break
        words.append(w)
        i += 1
    vocab = {t: k for k, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_bench_model(path: Path = DEFAULT_DIR, seed: int = 0, **overrides) -> Path:
    """Write the model once; later calls reuse the folder if its config matches."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = {**BENCH_LLAMA, **overrides}
    path = Path(path)
    marker = path / "pdserve_bench.json"
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, **spec}:
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**spec, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    build_tokenizer(spec["vocab_size"]).save_pretrained(path)
    marker.write_text(json.dumps({"seed": seed, **spec}))
    return path


def random_prompt(n: int, seed: int, vocab_size: int = 32000) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]
