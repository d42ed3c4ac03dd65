"""The KV pool: one allocation laid out block-major, [num_blocks, layers, 2, block_size, kv_heads,
head_dim]. Each layer sees strided per-layer K and V pools of num_blocks x block_size x kv_heads x
head_dim; each block (all layers, K and V) is one contiguous buffer, so a run of consecutive
blocks leaves as one zero-copy frame and an arriving frame lands with one copy per block.

This is the only place that turns pool memory into bytes or bytes into pool memory: KV export
and import go through `frames` and `land`, and nothing outside engine/ touches `data`."""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from engine import kernels
from engine.huge_pages import huge_page_mapping, tensor_over
from engine.model_meta import KVLayout, ModelSpec

# A frame this big or bigger lands with streaming stores (csrc/stream_copy.c); a smaller one by
# memcpy, whose cached lines a short prompt's first decode step reads soon after.
STREAM_MIN_BYTES = 256 << 10


def block_runs(block_ids: Sequence[int], max_blocks: int) -> list[tuple[int, int]]:
    """Split block ids into runs of consecutive ids (start, count), each at most max_blocks long."""
    runs: list[tuple[int, int]] = []
    for bid in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == bid and runs[-1][1] < max_blocks:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((bid, 1))
    return runs


class KVCache:
    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: str, device: torch.device,
                 shared: bool = False) -> None:
        """`shared` (CPU): the pool lives in a memfd that other processes of this host may map
        (`shared_fd`), so that a KV transport can hand them blocks without copying them out."""
        from engine.loader import DTYPES

        self.num_blocks, self.block_size = num_blocks, block_size
        self.layout = KVLayout.of(spec, dtype, block_size)
        shape = (num_blocks, *self.layout.block_shape)
        self.shared_fd: int | None = None
        if shared and device.type == "cpu" and hasattr(os, "memfd_create"):
            self.data = self._shared_zeros(shape, DTYPES[dtype])
        elif device.type == "cpu" and num_blocks and hasattr(mmap, "MADV_HUGEPAGE"):
            self.data = self._private_zeros(shape, DTYPES[dtype])
        else:
            self.data = torch.zeros(shape, dtype=DTYPES[dtype], device=device)
        self.layers = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(spec.num_layers)]
        # The CPU pool's bytes, made once: `frames` and `land` slice them. Through torch, each
        # call's slice, reshape, view and numpy() cost 50-55 us on a thread just woken (a
        # transfer wakes several), where a memoryview slice costs a few.
        self._bytes = memoryview(self.data.view(-1).view(torch.uint8).numpy()) if device.type == "cpu" else None
        if self._bytes is not None:
            kernels.stream_copy()  # built (or loaded) now: not on the thread landing the first transfer (0.4 s cold)

    def _private_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool in anonymous memory advised into transparent huge pages (where the host's
        THP mode is "madvise", as here, torch's heap gets none). Decode attention reads each
        sequence's blocks scattered over the pool, 8 pages of 4 KiB per block and layer, and
        with 4 KiB pages nearly every one is likely a TLB miss (this VM has no counters to tell):
        the 50M model's batch-32 decode step took 23.1 ms (median of six runs, 21.9-24.4) in huge
        pages against 25.3 ms (22.8-26.0) without, alternating, on a 2-core AMD EPYC. Where THP
        is off, the advice does nothing."""
        # Every page faulted in now (as torch.zeros did), not by the first steps that use it; a
        # fresh anonymous mapping is zeros already.
        self._mmap, skip = huge_page_mapping(self.num_blocks * self.layout.block_nbytes)
        return tensor_over(self._mmap, dtype, shape, skip)

    def _shared_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = self.num_blocks * self.layout.block_nbytes
        fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled, as torch.zeros
            self._mmap = mmap.mmap(fd, nbytes)
        except OSError:
            os.close(fd)
            raise
        self.shared_fd = fd
        data = tensor_over(self._mmap, dtype, shape)
        # Written now, as torch.zeros writes its pages: the first write to each shared page
        # faults (MAP_POPULATE maps shared pages read-only, so the write still faults), and a
        # 2048-token prefill writing 32 MiB of fresh blocks took ~12% longer than from a private
        # pool while its blocks were new.
        data.zero_()
        return data

    def memory(self) -> memoryview:
        """The whole pool's bytes (CPU only)."""
        if self._bytes is None:
            raise ValueError("a KV pool off the CPU has no host bytes")
        return self._bytes

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: str) -> int:
        return KVLayout.of(spec, dtype, block_size).block_nbytes

    def frames(self, block_ids: Sequence[int], max_frame_bytes: int, copy: bool = False,
               ) -> tuple[list[memoryview], list[int]]:
        """Byte views of the given blocks, one per run of consecutive ids (zero-copy on CPU; a GPU
        pool is staged through host memory). Valid while the blocks stay allocated, or for as
        long as they are held with `copy`."""
        bnb = self.layout.block_nbytes
        per_frame = max(1, max_frame_bytes // bnb)
        views, counts = [], []
        for start, count in block_runs(block_ids, per_frame):
            if self._bytes is not None and not copy:
                views.append(self._bytes[start * bnb:(start + count) * bnb])
            else:
                t = self.data[start:start + count]
                t = t.cpu() if t.device.type != "cpu" else t.clone()
                views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            counts.append(count)
        return views, counts

    def land(self, block_ids: Sequence[int], buf: memoryview | bytes) -> None:
        """Copy a frame holding len(block_ids) whole blocks into those blocks."""
        n = len(block_ids)
        if memoryview(buf).nbytes != n * self.layout.block_nbytes:
            raise ValueError(f"frame of {memoryview(buf).nbytes} bytes does not hold {n} blocks of "
                             f"{self.layout.block_nbytes}")
        # One copy per run of consecutive destination blocks: a per-block copy costs ~8 us of
        # dispatch each, which was most of the landing time of a 256 MiB transfer.
        if self._bytes is not None:
            # On the calling thread (a receiver's), never a torch copy: one this large opens an
            # OpenMP region, and a thread that does gets an OpenMP team of its own, which slows the
            # engine's steps (pdcommon/engine_loop.py says how).
            src_bytes, bnb, j = memoryview(buf).cast("B"), self.layout.block_nbytes, 0
            copy = kernels.stream_copy() if src_bytes.nbytes >= STREAM_MIN_BYTES else None
            if copy is not None:  # streaming stores, without the GIL (csrc/stream_copy.c)
                src, base = np.frombuffer(src_bytes, dtype=np.uint8).ctypes.data, self.data.data_ptr()
            for start, count in block_runs(block_ids, n):
                size = count * bnb
                if copy is not None:
                    copy(base + start * bnb, src + j, size)
                else:
                    self._bytes[start * bnb:start * bnb + size] = src_bytes[j:j + size]
                j += size
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only receive buffers: only read from here
            src = torch.frombuffer(buf, dtype=torch.uint8).view(self.data.dtype).view(n, *self.layout.block_shape)
        j = 0
        for start, count in block_runs(block_ids, n):
            self.data[start:start + count].copy_(src[j:j + count])
            j += count
