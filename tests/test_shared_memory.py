"""Same-host KV through shared memory (transfer/shared_memory.py): a sender offers the memfd its
KV pool lives in, a receiver that can map it says so, and later frames go as references that
the receiver checks and lands from the sender's memory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache import KVCache
from engine.model_meta import ModelSpec
from pdcommon.client import make_request
from tests.cluster_utils import InProcessCluster, make_config
from transfer import TransferState, build_header, make_receiver, make_sender
from transfer.shared_memory import BOOT_ID, REF, RegionMaps, SharedRegion, readonly_address

# Linux only: memfd_create and the kernel's boot id are what the feature stands on.
pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create") or not BOOT_ID, reason="needs memfd and a boot id")
SPEC = ModelSpec("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 1e-6, 512, False)


class Sink:
    def __init__(self) -> None:
        self.frames: dict[str, list[bytes]] = {}

    def open(self, header) -> None:
        self.frames[header.request_id] = []

    def frame(self, header, index, buf) -> None:
        self.frames[header.request_id].append(bytes(buf))


def _pool() -> KVCache:
    kv = KVCache(SPEC, 64, 16, "float32", torch.device("cpu"), shared=True)
    kv.data.copy_(torch.randn(kv.data.shape))
    return kv


def _transfer(tx, rx, kv: KVCache, rid: str, blocks: list[int], ack: bool = True, before_poll=None):
    frames, counts = kv.frames(blocks, 4 * kv.layout.block_nbytes)
    header = build_header(rid, "float32", list(kv.layout.block_shape), kv.layout.block_nbytes,
                          list(range(len(blocks))), frames, counts, checksums=False)
    h = tx.send(rx.address, header, frames, timeout_s=10)
    sent = [bytes(f) for f in frames]
    if before_poll is not None:
        before_poll()
    got = []
    end = time.monotonic() + 10
    while not got and time.monotonic() < end:
        got = rx.poll(0.02)
    assert got, "the transfer never arrived"
    if ack:
        got[0].ack(not got[0].error, got[0].error)
    while not h.done and time.monotonic() < end:
        tx.poll()
        time.sleep(0.002)
    return h, got[0], sent


def test_same_host_frames_go_by_reference_after_the_receiver_maps_the_pool():
    kv = _pool()
    sink = Sink()
    rx, tx = make_receiver("zmq", sink=sink), make_sender("zmq")
    try:
        assert tx.share(kv.shared_fd, kv.memory())
        # The first transfer offers the pool and goes as bytes; the receiver's ack says it mapped it.
        h, item, sent = _transfer(tx, rx, kv, "a", [3, 4, 5, 9, 10])
        assert h.state is TransferState.DONE and sink.frames["a"] == sent
        assert tx.bytes_by_reference == 0 and tx.peer_maps == {rx.address: True}
        # Then by reference: the same bytes land, none of them through the socket.
        h, item, sent = _transfer(tx, rx, kv, "b", [20, 21, 22, 23, 24, 30, 2])
        assert h.state is TransferState.DONE and not item.error
        assert sink.frames["b"] == sent and len(sent) == 4
        assert tx.bytes_by_reference == h.nbytes == 7 * kv.layout.block_nbytes
        assert rx.regions.num_mapped == 1
        # Frames outside the shared pool (a copy) go as bytes to the same receiver.
        frames = [memoryview(bytes(kv.frames([7], 1 << 20)[0][0]))]
        header = build_header("c", "float32", list(kv.layout.block_shape), kv.layout.block_nbytes, [0],
                              frames, [1])
        h = tx.send(rx.address, header, frames, timeout_s=10)
        while not h.done:
            for it in rx.poll(0.02):
                it.ack(True)
            tx.poll()
        assert h.state is TransferState.DONE and sink.frames["c"] == [bytes(frames[0])]
        assert tx.bytes_by_reference == 7 * kv.layout.block_nbytes
    finally:
        tx.close()
        rx.close()


def test_a_receiver_that_does_not_map_gets_bytes():
    kv = _pool()
    sink = Sink()
    rx, tx = make_receiver("zmq", sink=sink, shared_memory=False), make_sender("zmq")
    try:
        tx.share(kv.shared_fd, kv.memory())
        for rid in ("a", "b"):
            h, _, sent = _transfer(tx, rx, kv, rid, [1, 2, 3])
            assert h.state is TransferState.DONE and sink.frames[rid] == sent
        assert tx.bytes_by_reference == 0 and tx.peer_maps == {rx.address: False}
        assert rx.regions.num_mapped == 0
    finally:
        tx.close()
        rx.close()


def test_blocks_changed_after_sending_fail_their_checksum():
    """A reference is read when the frame is landed, and its checksum after that: bytes the sender
    changed since it hashed them (blocks reused after a cancel) fail the transfer, whose import
    the decode worker then never commits."""
    kv = _pool()
    sink = Sink()
    rx, tx = make_receiver("zmq", sink=sink), make_sender("zmq")
    try:
        tx.share(kv.shared_fd, kv.memory())
        _transfer(tx, rx, kv, "a", [1])

        def scribble() -> None:
            kv.data[41].fill_(0.0)

        h, item, _ = _transfer(tx, rx, kv, "b", [40, 41], before_poll=scribble)
        assert "checksum" in item.error and "frame 0" in item.error
        assert h.state is TransferState.FAILED and tx.bytes_by_reference == 2 * kv.layout.block_nbytes
    finally:
        tx.close()
        rx.close()


def test_only_the_offered_memfd_itself_is_mapped():
    kv = _pool()
    region = SharedRegion.of(kv.shared_fd, kv.memory())
    offer = region.offer
    maps = RegionMaps()
    # Another host's numbers, or a descriptor whose inode is not the offered one (a reused PID).
    assert not maps.map({**offer, "boot": "another-host"})
    assert not maps.map({**offer, "ino": offer["ino"] + 1})
    assert not maps.map({**offer, "pid": 2 ** 22 + 7})  # no such process
    with open(__file__, "rb") as f:  # a descriptor that is a file, not a memfd, even with its own numbers
        st = os.fstat(f.fileno())
        assert not maps.map({**offer, "fd": f.fileno(), "dev": st.st_dev, "ino": st.st_ino, "size": 16})
    assert maps.num_mapped == 0
    assert maps.map(offer) and maps.num_mapped == 1
    ref = region.ref(kv.frames([5], 1 << 20)[0][0])
    assert bytes(maps.frame(offer, ref)) == bytes(kv.frames([5], 1 << 20)[0][0])
    from transfer import TransferError

    with pytest.raises(TransferError, match="outside"):
        maps.frame(offer, REF.pack(region.nbytes - 8, 16))
    maps.close()
    assert maps.num_mapped == 0
    # A view outside the pool is not a reference.
    assert region.ref(memoryview(np.zeros(16, dtype=np.uint8))) is None
    os.fstat(kv.shared_fd)  # the pool's descriptor is untouched by the receiver's close


def _resident_bytes(address: int) -> int:
    """Rss of this process's mapping that starts at `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


@pytest.mark.skipif(not _kernel_at_least(5, 14), reason="MADV_POPULATE_READ needs Linux 5.14")
def test_a_mapped_region_is_populated_before_any_frame_is_read():
    """A fresh mapping's pages fault in one at a time as they are first read (landing 32 MiB so
    took 1.8x as long); the receiver maps them all in on a thread of its own once it maps."""
    kv = _pool()
    region = SharedRegion.of(kv.shared_fd, kv.memory())
    maps = RegionMaps()
    assert maps.map(region.offer)
    head = maps.frame(region.offer, REF.pack(0, 16))  # a view: it reads nothing
    base = readonly_address(head)
    end = time.monotonic() + 10
    while _resident_bytes(base) < region.nbytes and time.monotonic() < end:
        time.sleep(0.01)
    assert _resident_bytes(base) >= region.nbytes
    head.release()
    maps.close()


@pytest.mark.parametrize("shared", [True, False])
def test_disaggregated_cluster_lands_kv_from_the_prefill_pool(stories_path, story, shared):
    """1 prefill + 1 decode on one host: after the first request the KV goes by reference, and
    every request decodes exactly what the engine alone does."""
    prompts = [story[i:i + 120] for i in (0, 40, 80)]
    eng = LLMEngine(EngineConfig(model=stories_path))
    refs = [r["token_ids"] for r in eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                         ignore_eos=True))]
    cfg = make_config(stories_path, **{"transfer.shared_memory": shared})
    assert cfg.engine_config("prefill").kv_shared_memory is shared
    assert not cfg.engine_config("decode").kv_shared_memory
    with InProcessCluster(cfg) as cl, cl.client() as c:
        outs = [c.generate(make_request(p, max_tokens=12, ignore_eos=True)) for p in prompts]
        assert [o.token_ids for o in outs] == refs
        sender = next(rt for rt in cl.runtimes() if rt.role == "prefill").service.shipper.sender
        by_ref = sum(o.usage["kv_transfer_bytes"] for o in outs[1:])
        assert sender.bytes_by_reference == (by_ref if shared else 0) and (by_ref > 0)
        # The prefill worker's heartbeat reports how many decode workers map its pool.
        end = time.monotonic() + 10
        while time.monotonic() < end:
            seen = [w.kv_shared_peers for w in c.status().workers if w.role == "prefill"]
            if seen == [int(shared)]:
                break
            time.sleep(0.2)
        assert seen == [int(shared)]
        cl.wait_idle()


def test_frames_by_reference_are_cut_to_cache_sized_pieces_of_whole_blocks():
    from transfer.shared_memory import cut_frames

    kv = _pool()
    bnb = kv.layout.block_nbytes
    frames, counts = kv.frames(list(range(10)) + [20, 21, 22], 16 * bnb)
    header = build_header("r", "float32", list(kv.layout.block_shape), bnb, list(range(13)), frames, counts)
    whole = b"".join(bytes(f) for f in frames)
    pieces = cut_frames(header, frames, 3 * bnb + 5)
    assert [f.num_blocks for f in header.frames] == [3, 3, 3, 1, 3]
    assert [p.nbytes for p in pieces] == [f.nbytes for f in header.frames]
    assert b"".join(bytes(p) for p in pieces) == whole
    assert [f.num_blocks for f in (cut_frames(header, pieces, 1) and header.frames)] == [1] * 13


RECEIVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from transfer import make_receiver

class Sink:
    def open(self, header): pass
    def frame(self, header, index, buf): pass

rx = make_receiver("zmq", sink=Sink())
print(rx.address, flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    for item in rx.poll(0.05):
        item.ack(not item.error, item.error)
"""


def test_a_receiver_in_another_pid_namespace_gets_bytes(tmp_path):
    """Two pods on one node: same boot, different PID namespaces. The offer's PID means nothing
    there (or another process), so the receiver does not map it and the KV goes as bytes."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("needs unshare --pid (root)")
    repo = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", RECEIVER, repo],
                            stdout=subprocess.PIPE, text=True)
    tx = make_sender("zmq")
    try:
        address = proc.stdout.readline().strip()
        kv = _pool()
        assert tx.share(kv.shared_fd, kv.memory())
        for rid in ("a", "b", "c"):
            frames, counts = kv.frames([1, 2, 3, 8], 1 << 20)
            header = build_header(rid, "float32", list(kv.layout.block_shape), kv.layout.block_nbytes,
                                  list(range(4)), frames, counts, checksums=False)
            h = tx.send(address, header, frames, timeout_s=20)
            while not h.done:
                tx.poll()
                time.sleep(0.005)
            assert h.state is TransferState.DONE, h.error
        assert tx.peer_maps == {address: False} and tx.bytes_by_reference == 0
    finally:
        tx.close()
        proc.kill()
        proc.wait()
