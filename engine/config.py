"""Engine configuration: the one schema for both pools. The cluster YAML's `engine:` section and
per-pool `engine:` overrides are validated against these fields (see pdcommon.config)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

DType = Literal["float32", "bfloat16", "float16"]
GemmLayout = Literal["auto", "native", "mkl", "onednn", "both"]
_GEMM_LAYOUTS = get_args(GemmLayout)
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: DType = "float32"
    device: str = "cpu"
    block_size: int = 16
    # KV pool size: an explicit block count wins, else a byte budget.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 2048
    # Sequences in the batch, imported ones still waiting for their KV included.
    max_num_seqs: int = 256
    # Largest prompt chunk one sequence may compute in a step; None = the whole token budget.
    prefill_chunk_size: int | None = None
    enable_prefix_caching: bool = True
    # A waiting prompt that fits in one chunk goes before a running longer prompt's next chunk
    # (engine/scheduler.py): short prompts are not stuck behind long ones' chunks.
    short_prompts_first: bool = True
    max_model_len: int | None = None
    # torch compute threads; None leaves torch's default (all cores). Workers sharing a host set 1.
    num_threads: int | None = None
    # CPU GEMMs of the linear layers (engine/gemm_plan.py, engine/linear.py). "auto" measures at
    # load which kernel is fastest for each weight shape and row count on this host: MKL, oneDNN
    # (vLLM's CPU layout) or the native panel GEMM (engine/csrc/panel_gemm.c), keeping a second
    # copy of the weights for whichever of the last two wins somewhere. Fixed choices: "native"
    # (panels up to 8192 rows, MKL above, for layers of 32K+ weights: the fastest on an AMD EPYC
    # host), "both" (oneDNN from 2 to 128 rows, MKL otherwise), "onednn" (one copy) and "mkl" (one
    # copy: where memory is tighter than time). The native kernel needs fp32 and a C compiler;
    # oneDNN fp32, or bf16 with AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere MKL runs.
    cpu_gemm: GemmLayout = "auto"
    # Decode steps run their layers layer by layer from Python, never as one native call
    # (engine/decode_step.py; as vLLM's enforce_eager skips CUDA graphs). The same tokens either
    # way: for debugging and for comparing the two.
    enforce_eager: bool = False
    seed: int = 0
    # Device emulation, off by default: every engine step also sleeps this many seconds per token
    # it computes, standing in for a slower accelerator. On a small CPU machine compute stops
    # growing at a couple of busy workers; with the sleep (which frees the core) a pool's capacity
    # grows with its replicas, so the planner's live test can see more workers help. Never for
    # serving.
    emulate_device_s_per_token: float = 0.0
    # CPU: keep the KV pool in shared memory (a memfd) that a KV receiver on this host may map and
    # land blocks from directly (transfer/shared_memory.py). Set for prefill workers by
    # transfer.shared_memory; no cost to the engine's own steps.
    kv_shared_memory: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EngineConfig.model must name a local Hugging Face model folder")
        self.model = os.fspath(self.model)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "prefill_chunk_size", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ValueError(f"{name} must be >= 1 when set, got {value}")
        if self.cpu_gemm not in _GEMM_LAYOUTS:
            raise ValueError(f"cpu_gemm must be one of {', '.join(_GEMM_LAYOUTS)}; got {self.cpu_gemm!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.emulate_device_s_per_token < 0:
            raise ValueError(f"emulate_device_s_per_token must be >= 0, got {self.emulate_device_s_per_token}")

    @property
    def chunk_size(self) -> int:
        return min(self.prefill_chunk_size or self.max_num_batched_tokens, self.max_num_batched_tokens)
