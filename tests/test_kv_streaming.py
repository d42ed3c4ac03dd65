"""A long prompt's KV ships in parts while its later chunks are computed (transfer.stream_min_bytes):
the engine hands each chunk's blocks over on its output, the prefill worker sends them as
transfers of their own, and the decode worker lands them in any order, refusing overlaps, and
starts the sequence on the part with the first token."""

from __future__ import annotations

import threading

import pytest

from decode_worker.kv_import import check_header
from engine import EngineConfig, KVReservation, LLMEngine, SamplingParams
from pdcommon.client import make_request
from prefill_worker.kv_export import merge_exports, pack_export
from tests.cluster_utils import InProcessCluster, make_config
from transfer import TransferError

CHUNK = 64  # tokens: 4 blocks of 16


def _flat(exp) -> bytes:
    return b"".join(bytes(f) for f in exp.frames)


def test_each_chunk_exports_the_blocks_it_completed_and_the_first_token_the_rest(stories_path, story):
    eng = LLMEngine(EngineConfig(model=stories_path, prefill_chunk_size=CHUNK))
    prompt = story[:250]  # 16 blocks, the last one partial
    eng.add_request("s", prompt, SamplingParams(max_tokens=8, temperature=0), prefill_only=True, stream_kv_from=2)
    parts, first = [], None
    while first is None:
        for out in eng.step():
            assert out.kv_part is not None
            if out.new_token_ids:
                first = out
            else:
                parts.append(out.kv_part)
    # Chunks end at tokens 64, 128, 192: blocks 2-3, 4-7, 8-11 (0-1 the receiver holds already).
    assert [(p.first_block, p.num_blocks, p.first_token) for p in parts] == [(2, 2, -1), (4, 4, -1), (8, 4, -1)]
    rest = first.kv_part
    assert (rest.first_block, rest.num_blocks, rest.first_token) == (12, 4, first.new_token_ids[0])
    whole = merge_exports([*parts, rest])
    assert _flat(whole) == _flat(eng.export_kv("s", 2))  # the same bytes as one export after the prefill
    assert whole.block_hashes == eng.export_kv("s", 2).block_hashes
    with pytest.raises(ValueError, match="not consecutive"):
        merge_exports([parts[0], parts[2]])


def test_without_chunk_parts_the_whole_kv_comes_with_the_first_token_in_its_step(stories_path, story):
    """kv_chunks=False (the prefill pool's default on CPU): the prompt is still computed in chunks,
    but no chunk hands over a copy of its blocks; the output with the first token carries the whole
    KV, zero-copy, as export_kv would after it."""
    eng = LLMEngine(EngineConfig(model=stories_path, prefill_chunk_size=CHUNK))
    eng.add_request("s", story[:250], SamplingParams(max_tokens=8, temperature=0), prefill_only=True,
                    stream_kv_from=2, kv_chunks=False)
    outs = []
    while not any(o.new_token_ids for o in outs):
        outs += eng.step()
    assert len(outs) == 1 and outs[0].kv_part is not None, "a chunk handed over a part of its own"
    rest = outs[0].kv_part
    assert (rest.first_block, rest.num_blocks, rest.first_token) == (2, 14, outs[0].new_token_ids[0])
    assert _flat(rest) == _flat(eng.export_kv("s", 2))


def _reservation(header, held: int = 0) -> KVReservation:
    n = held + header.num_blocks
    return KVReservation("r", type("L", (), {"dtype": header.dtype, "block_shape": tuple(header.block_shape),
                                             "block_nbytes": header.block_nbytes})(),
                         list(range(n)), held, n, [*header.block_hashes])


def test_parts_land_in_any_order_once_each_and_the_first_token_ends_them(stories_path, story):
    eng = LLMEngine(EngineConfig(model=stories_path, prefill_chunk_size=CHUNK))
    eng.add_request("s", story[:250], SamplingParams(max_tokens=8, temperature=0), prefill_only=True,
                    stream_kv_from=0)
    exports = []
    while not exports or exports[-1].first_token < 0:
        exports += [o.kv_part for o in eng.step() if o.kv_part is not None]
    headers = [pack_export(e, 0)[0] for e in exports]
    res = _reservation(pack_export(merge_exports(exports), 0)[0])
    claimed = bytearray(len(res.missing_block_ids))
    for h in (headers[2], headers[0], headers[1]):  # out of order: gRPC streams are not ordered
        check_header(h, res, claimed)
    with pytest.raises(TransferError, match="shipped already"):
        check_header(headers[1], res, claimed)
    check_header(headers[-1], res, claimed)
    assert all(claimed)
    # A part that says it carries the first token must end at the last block.
    early = pack_export(exports[0], 0)[0]
    early.meta["first_token"] = 1
    with pytest.raises(TransferError, match="expected"):
        check_header(early, res, bytearray(len(res.missing_block_ids)))


class RecordingSender:
    """Wraps the prefill worker's real sender and notes what each transfer covers."""

    def __init__(self, inner) -> None:
        self.inner, self.sent = inner, []
        self.lock = threading.Lock()

    def send(self, dest, header, frames, timeout_s, **kw):
        with self.lock:
            self.sent.append((header.request_id, header.first_block, header.num_blocks, "first_token" in header.meta))
        return self.inner.send(dest, header, frames, timeout_s, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_streamed_kv_across_the_wire_equals_engine_alone(stories_path, story, transport):
    """300 prompt tokens in 64-token chunks, every chunk's blocks sent as they are done: the
    request took five transfers, consecutive, only the last with the first token, and decodes
    exactly what the engine alone does."""
    prompt = story[:300]
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]["token_ids"]
    cfg = make_config(stories_path, **{"transfer.stream_min_bytes": 1, "transfer.transport": transport,
                                       "prefill.engine.prefill_chunk_size": CHUNK})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        rt = next(rt for rt in cl.runtimes() if rt.role == "prefill")
        rt.service.shipper.sender = rec = RecordingSender(rt.service.shipper.sender)
        out = c.generate(make_request(prompt, max_tokens=30, ignore_eos=True))
        assert out.token_ids == ref
        sent = [s[1:] for s in rec.sent]
        assert sent == [(0, 4, False), (4, 4, False), (8, 4, False), (12, 4, False), (16, 3, True)], sent
        assert out.usage["kv_transfer_bytes"] == 19 * (5 * 2 * 16 * 4 * 8 * 4)  # every block, counted once
        cl.wait_idle()


def test_without_streaming_the_kv_ships_whole_after_the_first_token(stories_path, story):
    cfg = make_config(stories_path, **{"transfer.stream_min_bytes": 0, "prefill.engine.prefill_chunk_size": CHUNK})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        rt = next(rt for rt in cl.runtimes() if rt.role == "prefill")
        rt.service.shipper.sender = rec = RecordingSender(rt.service.shipper.sender)
        c.generate(make_request(story[:300], max_tokens=4, ignore_eos=True))
        assert [s[1:] for s in rec.sent] == [(0, 19, True)]
        cl.wait_idle()


def test_stream_default_is_off_on_cpu_and_chunks_the_prefill_pool_where_on(stories_path):
    cpu = make_config(stories_path)
    assert cpu.kv_stream_min_bytes == 0 and cpu.engine_config("prefill").prefill_chunk_size is None
    on = make_config(stories_path, **{"transfer.stream_min_bytes": 1 << 20})
    assert on.engine_config("prefill").prefill_chunk_size == 512
    assert on.engine_config("decode").prefill_chunk_size is None
