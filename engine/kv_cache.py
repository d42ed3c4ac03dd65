"""The KV pool: one allocation laid out block-major, [num_blocks, layers, 2, block_size, kv_heads,
head_dim]. Each layer sees strided per-layer K and V pools of num_blocks x block_size x kv_heads x
head_dim; each block (all layers, K and V) is one contiguous buffer, so exporting a block for
transfer is a zero-copy view and importing one is a single copy."""

from __future__ import annotations

import torch

from engine.model import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.block_shape = (spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros((num_blocks, *self.block_shape), dtype=dtype, device=device)
        self.layers = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(spec.num_layers)]

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * elem

    @property
    def block_nbytes(self) -> int:
        return self.data[0].nbytes

    def block(self, block_id: int) -> torch.Tensor:
        """The contiguous buffer of one block (a view: read it before the block is reused)."""
        return self.data[block_id]

    def write_block(self, block_id: int, src: torch.Tensor) -> None:
        if tuple(src.shape) != self.block_shape or src.dtype != self.data.dtype:
            raise ValueError(f"block buffer of shape {tuple(src.shape)}/{src.dtype} does not fit "
                             f"{self.block_shape}/{self.data.dtype}")
        self.data[block_id].copy_(src)
