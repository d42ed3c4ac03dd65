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
from engine.kernels import panel_gemm
from engine.kernels import rms_norm as native_rms_norm
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


# With both copies, oneDNN runs from 2 to this many rows and MKL the rest: on an AMD EPYC host
# oneDNN was 1.1-1.7x faster at 2-128 rows and MKL 3-11% faster from 200 on (4 linears of the 50M
# model, 2 threads); at one row they tie, and one row was MKL's best case on Intel.
ONEDNN_MAX_ROWS = 128
# The native panel GEMM (engine/csrc/panel_gemm.c) serves up to this many rows (an engine step's
# tokens: MKL only past it), for weights of at least NATIVE_MIN_WEIGHT elements. On the 50M
# benchmark model's layers (AMD EPYC, AVX2, 2 threads, weights read from memory as in a step) it
# ran 1 row 1.6-2.1x faster than MKL or oneDNN, 8 rows 1.5x and 32 rows 1.3x faster than oneDNN;
# with its rows blocked, whole prompts of 256 / 512 / 1024 / 2048 tokens prefilled 12-19% / 8-11%
# / 4-8% / 2-12% faster than with MKL above 128 rows (three same-process runs). Below ~32K
# elements (the 64-wide layers of stories260K) a call is mostly overhead, and MKL's is the
# smallest: ~6 us, against ~11 us through ctypes and ~65 us for oneDNN.
NATIVE_MAX_ROWS = 8192
NATIVE_MIN_WEIGHT = 32768


class Linear(nn.Module):
    """y = x W^T + b, from up to two copies of W (EngineConfig.cpu_gemm, see `pack` and
    `pack_panels`):
    - `weight_t`, W transposed ([in, out]) for MKL: on CPU as fast as nn.Linear's layout for long
      prompts and up to ~1.7x faster at decode batches;
    - `packed`, W reordered for oneDNN, the layout vLLM's CPU backend runs;
    - `panels`, W in column panels for the native small-batch GEMM (decode)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.onednn_rows = range(0)  # row counts oneDNN serves (all of them without the MKL copy)
        self.panels: torch.Tensor | None = None
        self.native_rows = range(0)  # row counts the native panel GEMM serves

    def pack(self, keep_mkl: bool) -> None:
        """Add the oneDNN copy; without `keep_mkl`, it replaces the MKL one (half the memory)."""
        w = self.weight_t.detach().t().contiguous()
        # The row-count hint only tunes the blocking; the packed weight serves any number of rows.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        self.onednn_rows = range(2, ONEDNN_MAX_ROWS + 1) if keep_mkl else range(1, 1 << 62)
        if not keep_mkl:
            self.weight_t = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)

    def pack_panels(self) -> bool:
        """Add the native kernel's copy beside the MKL one, where the kernel is built and the
        weight is large enough to gain from it; whether it did."""
        w = self.weight_t.detach()
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.numel() < NATIVE_MIN_WEIGHT:
            return False
        fn = panel_gemm()
        if fn is None:
            return False
        k, n, nb = w.shape[0], w.shape[1], fn.panel_width
        padded = w.new_zeros(k, -(-n // nb) * nb)
        padded[:, :n] = w
        # Panel j: columns j*nb..(j+1)*nb of W^T, row after row, in one contiguous run.
        self.panels = padded.view(k, -1, nb).transpose(0, 1).contiguous()
        self.native_rows = range(1, NATIVE_MAX_ROWS + 1)
        return True

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = self.weight_t.shape[1]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        bias = None if self.bias is None else self.bias.data_ptr()
        panel_gemm()(x.data_ptr(), x.stride(0), m, k, self.panels.data_ptr(), n, bias, y.data_ptr(), n)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m in self.native_rows:
            return self._native(x)
        if m in self.onednn_rows:
            padded = gemm_rows(m)
            if padded != m:  # see gemm_rows: a few shapes, each compiled once
                x = torch.cat([x, x.new_zeros(padded - m, x.shape[1])])
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:m]
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def gemm_rows(m: int) -> int:
    """The row count a oneDNN GEMM of m rows runs at. oneDNN compiles a kernel per shape and keeps
    1024 in its cache; a serving engine sees every row count from 1 to its token budget, and
    compiling one costs ~1.7 ms per layer (50 ms per step of the 50M model), which made a served
    worker slower than MKL under load. Rounding up to 8 sizes per doubling (powers of two up to 8,
    then steps of an eighth of the power of two below, at least 8: under 1/8 padding from 64 rows
    on) keeps every shape of a token budget up to 8192 in the cache: 67 sizes x 5 weight shapes."""
    if m <= 8:
        return 1 << (m - 1).bit_length()
    step = max(8, 1 << ((m - 1).bit_length() - 4))
    return -(-m // step) * step


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
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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
        else:  # rotary on q and k heads together: half the ops of doing each alone
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta)
        x = residual + self.o_proj(attn.reshape(t, self.q_size))
        residual = x
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return residual + self.down_proj(self.act(gate) * up)


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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos = self.cos_table[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(x.dtype).unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
