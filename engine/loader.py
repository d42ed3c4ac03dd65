"""Load a local Hugging Face checkpoint (config, tokenizer, safetensors) into DecoderModel."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import DecoderModel, rope_tables
from engine.model_meta import (
    ModelLoadError,
    ModelSpec,
    eos_ids,
    load_tokenizer,
    model_spec,
    read_json,
    resolve_model_path,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: DecoderModel
    spec: ModelSpec
    tokenizer: object
    eos_token_ids: list[int]
    path: Path


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


def rope_inv_freq(path: Path, spec: ModelSpec, cfg: dict) -> tuple[torch.Tensor, float]:
    """Rotary frequencies. Plain RoPE is read from config.json here; scaled variants (linear,
    dynamic, yarn, llama3, ...) come from transformers, whose config and rope modules take ~2 s to
    import, so a worker serving a plain-RoPE model starts that much sooner."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") == "default":
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        d = spec.head_dim
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = AutoConfig.from_pretrained(path)
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
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


def load_model(model: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    path = resolve_model_path(model)
    dev = check_device_dtype(device, dtype)
    cfg = read_json(path / "config.json")
    spec = model_spec(cfg, path)
    tokenizer = load_tokenizer(path)
    inv_freq, attn_scale = rope_inv_freq(path, spec, cfg)
    weights = _fused_weights(_load_state(path), spec, path)
    with torch.device("meta"):
        net = DecoderModel(spec)  # no tensor op may run here: on the meta device each imports torch._dynamo
    try:
        missing, _ = net.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"weights in {path} do not match config.json: {e}") from e
    if missing:
        raise ModelLoadError(f"weights in {path} lack tensors: {missing[:5]}")
    net.cos_table = net.sin_table = torch.empty(0)
    net = net.to(device=dev, dtype=DTYPES[dtype]).eval()
    # Rope tables stay fp32 (as in transformers), whatever the weights' dtype.
    cos, sin = rope_tables(spec.max_position_embeddings, inv_freq, attn_scale)
    net.cos_table, net.sin_table = cos.to(dev), sin.to(dev)
    for p in net.parameters():
        p.requires_grad_(False)
    return LoadedModel(net, spec, tokenizer, eos_ids(path, cfg, tokenizer), path)
