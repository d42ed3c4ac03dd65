"""A decode step's decoder layers in one native call (engine/csrc/decode_step.c).

The kernels a decode step runs are native already; between them, on a batch-1 step of the 50M
benchmark model, Python spent ~1.6 ms of ~6 (nn.Module dispatch, tensor views, ctypes calls for
8 layers x ~10 kernels). `NativeDecodeStep` hands the same kernels, in the same order, to a C
driver that runs the layers without coming back to Python: the same bits, the GIL released for
the whole step. It takes a step only when every piece has its native kernel (see `takes`);
anything else runs through DecoderModel's layers as before.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, rows_packed
from engine.kernels import decode_step, elementwise, paged_decode, panel_gemm, rms_norm
from engine.linear import Linear

_P = ctypes.c_void_p


class StepLayer(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("in_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias",
                                  "gate_up_bias", "down_bias", "k_cache", "v_cache")]


class StepPlan(ctypes.Structure):  # csrc/decode_step.c's step_plan
    _fields_ = [*((n, ctypes.c_int64) for n in ("hidden", "inter", "heads", "kv_heads", "head_dim", "layers",
                                                 "block_size", "window", "block_stride", "token_stride",
                                                 "head_stride")),
                *((n, _P) for n in ("rms", "gemm", "rotary", "silu", "write_kv", "attn", "embed", "cos", "sin",
                                    "final_norm", "layer")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _addr(fn) -> int:
    return ctypes.cast(fn, _P).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linears(layer) -> list[Linear]:
    return [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]


def eligible(model) -> bool:
    """Whether the model's decode layers are all the driver knows: fp32 on the CPU, SiLU, rotary
    over whole heads, no qk norms, every kernel built, every linear layer with its panels."""
    spec, layers, embed = model.spec, list(model.layers), model.embed_tokens.weight
    if embed.dtype != torch.float32 or embed.device.type != "cpu":
        return False
    if model.cos_table.dim() != 2 or model.cos_table.shape[1] != spec.head_dim or not model.cos_table.is_contiguous():
        return False
    eps = model.norm.eps  # the driver takes one RMSNorm epsilon
    if not all(la.act is F.silu and la.q_norm is None and all(li.panels is not None for li in _linears(la))
               and la.input_layernorm.eps == la.post_attention_layernorm.eps == eps for la in layers):
        return False
    return all(k() is not None for k in (decode_step, elementwise, paged_decode, panel_gemm, rms_norm))


class NativeDecodeStep:
    """The driver's plan for one model and KV pool; `run` takes a step `takes` accepted."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        spec = model.spec
        self.model, self.pool_ptr = model, kv_caches[0][0].data_ptr()
        self._native_rows: dict[int, bool] = {}
        k0 = kv_caches[0][0]
        self._packed = all(rows_packed(k) and rows_packed(v) and k.stride() == v.stride() == k0.stride()
                           for k, v, *_ in kv_caches)
        ew = elementwise()
        # What the plan points into, held as long as the plan is, whatever later happens to the layers.
        self._held = [t for la in model.layers for li in _linears(la) for t in (li.panels, li.bias) if t is not None]
        self._layers = (StepLayer * len(model.layers))(*[self._layer(la, k, v) for la, (k, v, *_)
                                                        in zip(model.layers, kv_caches, strict=True)])
        self.plan = StepPlan(
            hidden=spec.hidden_size, inter=spec.intermediate_size, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, layers=len(model.layers), block_size=k0.shape[1],
            window=spec.sliding_window or 0, block_stride=k0.stride(0), token_stride=k0.stride(1),
            head_stride=k0.stride(2), rms=_addr(rms_norm()), gemm=_addr(panel_gemm()), rotary=_addr(ew.rotary),
            silu=_addr(ew.silu_mul), write_kv=_addr(ew.write_kv), attn=_addr(paged_decode()),
            embed=model.embed_tokens.weight.data_ptr(), cos=model.cos_table.data_ptr(),
            sin=model.sin_table.data_ptr(), final_norm=model.norm.weight.data_ptr(),
            layer=ctypes.cast(self._layers, _P), eps=model.norm.eps, scale=spec.head_dim ** -0.5)
        self._work = decode_step().work

    @staticmethod
    def _layer(la, k: torch.Tensor, v: torch.Tensor) -> StepLayer:
        return StepLayer(la.input_layernorm.weight.data_ptr(), la.post_attention_layernorm.weight.data_ptr(),
                         *(li.panels.data_ptr() for li in _linears(la)), *(_ptr(li.bias) for li in _linears(la)),
                         k.data_ptr(), v.data_ptr())

    def takes(self, meta: AttentionMetadata, kv_caches, keep: torch.Tensor | None, rows: int) -> bool:
        """A pure decode step in row order, every row kept, on the pool the plan was made for,
        with every linear layer routed to its panels at this many rows."""
        groups = meta.decode_groups
        if (keep is not None or meta.prefills or len(groups) != 1 or not groups[0].all_rows or not meta.native_decode
                or meta.slot_blocks is None or not self._packed or kv_caches[0][0].data_ptr() != self.pool_ptr):
            return False
        native = self._native_rows.get(rows)
        if native is None:
            native = self._native_rows[rows] = all(li.kernel_for(rows) == "native"
                                                   for la in self.model.layers for li in _linears(la))
        return native

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        rows, g = input_ids.shape[0], meta.decode_groups[0]
        work = torch.empty(self._work(ctypes.byref(self.plan), rows), dtype=torch.float32)
        out = torch.empty(rows, self.plan.hidden, dtype=torch.float32)
        tables, lens = g.block_tables, g.context_lens
        decode_step()(ctypes.byref(self.plan), rows, input_ids.data_ptr(), positions.data_ptr(),
                      meta.slot_blocks.data_ptr(), meta.slot_offsets.data_ptr(), tables.data_ptr(),
                      tables.stride(0), lens.data_ptr(), work.data_ptr(), out.data_ptr())
        return out
