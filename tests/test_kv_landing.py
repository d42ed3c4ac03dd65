"""Landing an arriving KV frame in the pool (KVCache.land): large frames go through the
streaming-store copy (engine/csrc/stream_copy.c), small ones through memcpy; both must put every
byte of the frame in its blocks, whatever the alignment of either side."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from engine import kernels
from engine.kv_cache import STREAM_MIN_BYTES, KVCache, block_runs
from engine.model_meta import ModelSpec

SPEC = ModelSpec("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 1e-6, 512, False)  # 8 KiB blocks


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 255, 256, 257, 4095, 4096 + 17, (1 << 20) + 13])
def test_stream_copy_copies_every_byte_at_any_alignment(n):
    copy = kernels.stream_copy()
    if copy is None:
        pytest.skip("no C compiler: KV lands by memcpy")
    rng = random.Random(n)
    for src_off, dst_off in ((0, 0), (1, 0), (0, 3), (5, 61), (17, 32)):
        src = ctypes.create_string_buffer(rng.randbytes(n + 64), n + 64)
        dst = ctypes.create_string_buffer(b"\xaa" * (n + 128), n + 128)
        copy(ctypes.addressof(dst) + dst_off, ctypes.addressof(src) + src_off, n)
        assert dst.raw[dst_off:dst_off + n] == src.raw[src_off:src_off + n]
        assert dst.raw[:dst_off] == b"\xaa" * dst_off and dst.raw[dst_off + n:] == b"\xaa" * (128 - dst_off)


@pytest.mark.parametrize("num_blocks", [3, 40])  # 24 KiB (memcpy) and 320 KiB (streaming)
def test_a_frame_lands_in_its_scattered_blocks(num_blocks):
    kv = KVCache(SPEC, 64, 16, "float32", torch.device("cpu"))
    bnb = kv.layout.block_nbytes
    assert (num_blocks * bnb >= STREAM_MIN_BYTES) == (num_blocks == 40)
    run = [20, 21]  # two consecutive blocks, landed with one copy, among single scattered ones
    ids = random.Random(num_blocks).sample([b for b in range(64) if b not in run], num_blocks - len(run))
    ids[1:1] = run
    assert len(block_runs(ids, num_blocks)) < num_blocks
    frame = torch.randn(num_blocks, *kv.layout.block_shape)
    buf = b"\0" + frame.numpy().tobytes()
    kv.land(ids, memoryview(buf)[1:])  # an unaligned, read-only source
    for i, b in enumerate(ids):
        assert torch.equal(kv.data[b], frame[i]), f"block {b} (frame position {i}) did not land"
    untouched = sorted(set(range(64)) - set(ids))
    assert not kv.data[untouched].any()
