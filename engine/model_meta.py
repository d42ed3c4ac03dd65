"""What a model folder says without loading weights: architecture spec, tokenizer, EOS ids,
context length, KV layout and an identity fingerprint. Never imports torch, so the router can
tokenize, validate and route with it alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import xxhash

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Files that decide what a worker computes: the same fingerprint means the same model and tokenizer.
_IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                   "tokenizer_config.json", "vocab.json", "merges.txt")


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be served; the message says which file or field is the problem."""


@dataclass(slots=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One KV block as it sits in a pool and travels on the wire: [layers, 2, block_size, kv_heads, head_dim]."""

    dtype: str
    block_shape: tuple[int, ...]

    @property
    def block_nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.block_shape:
            n *= d
        return n

    @classmethod
    def of(cls, spec: ModelSpec, dtype: str, block_size: int) -> KVLayout:
        return cls(dtype, (spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ModelLoadError(f"missing {path.name} in model folder {path.parent}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"corrupt {path.name} in {path.parent}: {e}") from e


def resolve_model_path(model: str) -> Path:
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model folder {model!r} not found; point EngineConfig.model (or --model / the YAML "
            f"'model' key) at a local Hugging Face folder with config.json and *.safetensors")
    return path


def model_spec(cfg: dict, path: Path) -> ModelSpec:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs or cfg.get('model_type')!r} in {path}; "
                             f"supported: {', '.join(SUPPORTED)}")
    family = SUPPORTED[arch]
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        window = cfg.get("sliding_window") if family == "mistral" or cfg.get("use_sliding_window") else None
        return ModelSpec(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json in {path} lacks required field {e.args[0]!r}") from e


def load_tokenizer(path: Path):
    """The Rust tokenizer alone where it serves the folder exactly (engine/tokenizer.py: no
    transformers import); else transformers' fast tokenizer straight from tokenizer.json
    (AutoTokenizer resolves the model config first, which imports torch, and the router must stay
    torch-free); AutoTokenizer only for slow tokenizers."""
    from engine.tokenizer import load_fast

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(f"no tokenizer (tokenizer.json / tokenizer.model / vocab.json) in {path}")
    try:
        fast = load_fast(path)
        if fast is not None:
            return fast
        from transformers import PreTrainedTokenizerFast

        if (path / "tokenizer.json").exists():
            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer  # slow tokenizers only; importing it loads torch

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a broken tokenizer
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e


def eos_ids(path: Path, cfg: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [read_json(gen).get("eos_token_id")] if gen.exists() else []
    sources += [cfg.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)]
    for src in sources:
        for t in src if isinstance(src, list) else [src]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


def fingerprint(path: Path) -> str:
    """xxh3 over the files that define the model's outputs (config and tokenizer), not the
    weights: cheap enough for every registration, and two folders with different configs or
    tokenizers never share it."""
    h = xxhash.xxh3_128()
    for name in _IDENTITY_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            h.update(f.read_bytes())
    return h.hexdigest()


@dataclass(slots=True)
class ModelInfo:
    path: str
    name: str
    spec: ModelSpec
    tokenizer: object
    eos_token_ids: list[int]
    max_model_len: int
    fingerprint: str

    @classmethod
    def load(cls, model: str, max_model_len: int | None = None) -> ModelInfo:
        path = resolve_model_path(model)
        cfg = read_json(path / "config.json")
        spec = model_spec(cfg, path)
        tok = load_tokenizer(path)
        limit = min(max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        return cls(str(path), path.name, spec, tok, eos_ids(path, cfg, tok), limit, fingerprint(path))

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
