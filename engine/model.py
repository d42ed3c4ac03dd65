"""Compact decoder-only transformer covering Llama, Mistral, Qwen2 and Qwen3.

The differences between the families are flags: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), sliding-window attention (Mistral). Projections are fused (qkv,
gate+up) so each layer issues four GEMMs. The engine owns the KV cache and attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.decode_step import NativeDecodeStep, eligible
from engine.kernels import elementwise as native_elementwise
from engine.kernels import rms_norm as native_rms_norm
from engine.linear import Linear
from engine.model_meta import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu" and (fn := native_rms_norm()):
                # One native call (engine/csrc/rms_norm.c): torch's CPU rms_norm is six ops.
                y = torch.empty(x.shape, dtype=x.dtype)
                fn(x.data_ptr(), x.stride(0), self.weight.data_ptr(), x.shape[0], x.shape[1], self.eps,
                   y.data_ptr(), x.shape[1])
                return y
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # bit-identical to the steps below
        # Same order of operations as transformers' LlamaRMSNorm: fp32 statistics, then scale.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, act) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, h, bias=spec.o_bias)
        self.gate_up_proj = Linear(h, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, h, bias=spec.mlp_bias)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.act = act

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`keep`: the rows whose output is wanted (the last layer's: the rows that sample). Every
        row's K and V still go to the cache; attention, o_proj and the MLP run for those rows only."""
        t = x.shape[0]
        residual = x
        x = self.input_layernorm(x)
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        elif (native := _native(qkv)) is not None and cos.is_contiguous() and cos.shape[-1] == self.head_dim:
            # In place on the projection's q and k heads, one pass (engine/csrc/elementwise.c).
            native.rotary(qkv.data_ptr(), qkv.stride(0), t, self.num_heads + self.num_kv_heads, self.head_dim,
                      cos.data_ptr(), sin.data_ptr(), cos.stride(0))
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        else:  # rotary on q and k heads together: half the ops of doing each alone
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, sampled_only=keep is not None)
        if keep is not None:
            attn, residual, t = attn[keep], residual[keep], keep.shape[0]
            if t == 0:
                return residual
        x = self.o_proj(attn.reshape(t, self.q_size), residual=residual)
        residual = x
        gate_up = self.gate_up_proj(self.post_attention_layernorm(x))
        width = gate_up.shape[1] // 2
        if self.act is F.silu and (native := _native(gate_up)) is not None:
            act = torch.empty(t, width, dtype=gate_up.dtype)
            native.silu_mul(gate_up.data_ptr(), gate_up.stride(0), t, width, act.data_ptr(), width)
        else:
            act = self.act(gate_up[:, :width]) * gate_up[:, width:]
        return self.down_proj(act, residual=residual)


def _native(x: torch.Tensor):
    """The native elementwise kernels, where they can take x (fp32 rows of unit stride on the CPU)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        return None
    return native_elementwise()


# The activations of the supported families, as transformers defines them; importing
# transformers.activations alone takes ~1 s (it pulls in torch.distributed and dynamo).
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def rope_tables(max_positions: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin per position, as transformers' rotary embedding computes them."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    emb = torch.outer(pos, inv_freq.float()).repeat(1, 2)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        act = activation(spec.hidden_act)
        # Given a weight, the embedding skips its random init: the loaded weights replace it anyway,
        # and a normal_() on the meta device imports torch._dynamo (1.8 s of every worker start).
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec, act) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Tied embeddings are read through F.linear (no transposed copy of the vocabulary matrix).
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # cos/sin tables in fp32, like transformers' rotary embedding, cast at lookup; the loader
        # builds them (rope_tables) on the model's device after the weights land.
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self._step: NativeDecodeStep | None = None  # prepare_native_step
        self.native_steps = 0  # decode steps run by the native step (engine/decode_step.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of the rows in `keep` (all rows when None), in its order.

        Only the last layer can skip rows: every layer before it feeds the next layer's K and V
        for every token. Its attention, o_proj and MLP then run for the kept rows alone, a
        prompt's last token: 1/L of a prompt's GEMMs and attention (on the 8-layer benchmark
        model, a tenth of its prefill), where transformers (logits_to_keep) and vLLM skip only
        the LM head for the rows that do not sample."""
        step = self._step
        if step is not None and step.takes(meta, kv_caches, keep, input_ids.shape[0]):
            self.native_steps += 1
            return step.run(input_ids, positions, meta)  # the same kernels, driven from C
        x = self.embed_tokens(input_ids)
        cos = self.cos_table[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(x.dtype).unsqueeze(1)
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, k_cache, v_cache, meta, keep if i == last else None)
        return self.norm(x)

    def prepare_native_step(self, kv_caches: list[tuple[torch.Tensor, ...]], enabled: bool = True) -> None:
        """Decode steps on this KV pool run as one native call from now on, where the model is one
        the driver runs (engine/decode_step.py); once its weights' copies and routes are final."""
        self._step = NativeDecodeStep(self, kv_caches) if enabled and eligible(self) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
