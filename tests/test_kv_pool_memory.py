"""Where a CPU KV pool lives: a private pool in anonymous memory advised into transparent huge
pages, starting on a huge-page boundary (decode attention reads blocks scattered over the pool,
and with 4 KiB pages nearly every block is likely a TLB miss); a shared pool (a prefill worker's) in
its memfd, as before. Both zero-filled, both the pool the engine reads and writes. The linear
layers' weights move into huge pages too."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from engine.huge_pages import HUGE_PAGE
from engine.kv_cache import KVCache
from engine.model_meta import ModelSpec

SPEC = ModelSpec("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 1e-6, 512, False)  # 8 KiB blocks


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


# The advice is refused only by a kernel built without THP (no such /sys entry); a host whose
# THP mode is "never" still records it (VmFlags hg) and gives the pool no huge pages.
@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="no transparent huge pages in this kernel")
def test_a_private_pool_is_aligned_private_and_advised_into_huge_pages():
    kv = KVCache(SPEC, 600, 16, "float32", torch.device("cpu"))  # 4.7 MiB: whole huge pages inside
    ptr = kv.data.data_ptr()
    assert ptr % HUGE_PAGE == 0
    flags = vm_flags(ptr)
    assert "hg" in flags, flags  # MADV_HUGEPAGE: the host's THP mode "madvise" gives it huge pages
    assert "sh" not in flags, flags  # a shared anonymous mapping is shmem, which gets none here
    assert kv.shared_fd is None
    assert not kv.data.any()
    kv.data[599].fill_(1.5)  # the last block lies inside the mapping
    assert kv.memory()[-4:] == torch.tensor([1.5]).numpy().tobytes()


def test_a_shared_pool_stays_in_its_memfd():
    kv = KVCache(SPEC, 8, 16, "float32", torch.device("cpu"), shared=True)
    assert kv.shared_fd is not None
    assert "sh" in vm_flags(kv.data.data_ptr())
    assert not kv.data.any()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="no transparent huge pages in this kernel")
def test_the_linear_layers_weights_are_advised_into_huge_pages_and_still_compute(stories_path):
    """Decode steps stream every weight; on the heap ("madvise" hosts give it 4 KiB pages) that
    is a TLB miss every 4 KiB. Every copy of a weight the GEMMs read (MKL's and the native
    kernel's) lives in one mapping advised into huge pages, and the engine's greedy tokens are
    those of the same weights left on the heap."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.linear import Linear

    eng = LLMEngine(EngineConfig(model=stories_path, cpu_gemm="both"))
    layers = [m for m in eng.model.modules() if isinstance(m, Linear)]
    copies = [t for m in layers for t in (m.weight_t, m.panels) if t is not None and t.numel()]
    assert len(copies) >= len(layers)
    for t in copies:
        assert "hg" in vm_flags(t.data_ptr()), t.shape
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = eng.tokenize("Once upon a time")
    moved = eng.generate([prompt], params)[0]["token_ids"]
    for m in layers:  # the same bytes back on the heap
        m.weight_t.data = m.weight_t.data.clone()
    assert "hg" not in vm_flags(layers[0].weight_t.data_ptr())
    assert eng.generate([prompt], params)[0]["token_ids"] == moved
