"""Load a local Hugging Face checkpoint (config, tokenizer, safetensors) into DecoderModel."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import DecoderModel, ModelSpec

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be served; the message says which file or field is the problem."""


@dataclass(slots=True)
class LoadedModel:
    model: DecoderModel
    spec: ModelSpec
    tokenizer: object
    eos_token_ids: list[int]
    path: Path


def _read_json(path: Path) -> dict:
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


def check_device_dtype(device: str, dtype: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but this torch build sees no CUDA device")
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ModelLoadError(f"dtype bfloat16 is not supported on {torch.cuda.get_device_name(dev)}")
    try:
        a = torch.ones(2, 2, dtype=DTYPES[dtype], device=dev)
        (a @ a).sum().item()
    except (RuntimeError, KeyError) as e:
        raise ModelLoadError(f"dtype {dtype} cannot run matrix products on device {device}: {e}") from e
    return dev


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


def rope_inv_freq(path: Path, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = AutoConfig.from_pretrained(path)
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        theta = float(rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))
        d = spec.head_dim
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r} in {path}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    return inv_freq, float(scaling)


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (pytorch_model.bin is not loaded for safety)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"corrupt weights file {f.name}: {e}") from e
    return state


def _fused_weights(state: dict[str, torch.Tensor], spec: ModelSpec, path: Path) -> dict[str, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        for key in (name, f"model.{name}"):
            if key in state:
                return state[key]
        raise ModelLoadError(f"weights in {path} lack tensor {name!r}")

    def t(w: torch.Tensor) -> torch.Tensor:  # engine Linear layers keep W as [in, out]
        return w.t().contiguous()

    out = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not spec.tie_word_embeddings:
        out["lm_head.weight_t"] = t(state.get("lm_head.weight", out["embed_tokens.weight"]))
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        out[p + "qkv_proj.weight_t"] = t(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
        if spec.qkv_bias:
            out[p + "qkv_proj.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        out[p + "o_proj.weight_t"] = t(take(p + "self_attn.o_proj.weight"))
        if spec.o_bias:
            out[p + "o_proj.bias"] = take(p + "self_attn.o_proj.bias")
        out[p + "gate_up_proj.weight_t"] = t(torch.cat([take(p + "mlp.gate_proj.weight"),
                                                         take(p + "mlp.up_proj.weight")]))
        out[p + "down_proj.weight_t"] = t(take(p + "mlp.down_proj.weight"))
        if spec.mlp_bias:
            out[p + "gate_up_proj.bias"] = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
            out[p + "down_proj.bias"] = take(p + "mlp.down_proj.bias")
        if spec.qk_norm:
            out[p + "q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            out[p + "k_norm.weight"] = take(p + "self_attn.k_norm.weight")
    return out


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(f"no tokenizer (tokenizer.json / tokenizer.model / vocab.json) in {path}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a broken tokenizer
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e


def eos_ids(path: Path, cfg: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [_read_json(gen).get("eos_token_id")] if gen.exists() else []
    sources += [cfg.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)]
    for src in sources:
        for t in src if isinstance(src, list) else [src]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


def load_model(model: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    path = resolve_model_path(model)
    dev = check_device_dtype(device, dtype)
    cfg = _read_json(path / "config.json")
    spec = model_spec(cfg, path)
    tokenizer = load_tokenizer(path)
    inv_freq, attn_scale = rope_inv_freq(path, spec)
    weights = _fused_weights(_load_state(path), spec, path)
    with torch.device("meta"):
        net = DecoderModel(spec, inv_freq.to("meta"), attn_scale)
    try:
        missing, _ = net.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"weights in {path} do not match config.json: {e}") from e
    if missing:
        raise ModelLoadError(f"weights in {path} lack tensors: {missing[:5]}")
    net.cos_table = net.sin_table = torch.empty(0)
    net = net.to(device=dev, dtype=DTYPES[dtype]).eval()
    # Rope tables stay fp32 (as in transformers) and are rebuilt here: meta tensors hold no data.
    pos = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
    emb = torch.outer(pos, inv_freq.float()).repeat(1, 2)
    net.cos_table = (emb.cos() * attn_scale).to(dev)
    net.sin_table = (emb.sin() * attn_scale).to(dev)
    for p in net.parameters():
        p.requires_grad_(False)
    return LoadedModel(net, spec, tokenizer, eos_ids(path, cfg, tokenizer), path)
