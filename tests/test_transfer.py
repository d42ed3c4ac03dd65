"""The KV wire format and both transports, over real sockets on 127.0.0.1."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest

from transfer import (
    KVHeader,
    TransferError,
    TransferHandle,
    TransferState,
    build_header,
    make_receiver,
    make_sender,
    verify,
)


def make_payload(n_frames: int = 3, blocks: int = 2, block_nbytes: int = 4096, seed: int = 0):
    rng = np.random.default_rng(seed)
    frames = [memoryview(rng.integers(0, 255, blocks * block_nbytes, dtype=np.uint8)) for _ in range(n_frames)]
    header = build_header("req-1", "float32", [2, 2, 4, 1, 128], block_nbytes, list(range(n_frames * blocks)),
                          frames, [blocks] * n_frames, first_block=1, meta={"first_token": 7})
    return header, frames


def test_header_round_trip():
    header, frames = make_payload()
    back = KVHeader.decode(header.encode())
    assert back == header and back.meta["first_token"] == 7 and back.total_bytes == 3 * 2 * 4096
    verify(back, frames)


def test_corrupt_and_truncated_are_rejected():
    header, frames = make_payload()
    bad = bytearray(frames[1])
    bad[100] ^= 0xFF
    with pytest.raises(TransferError, match="checksum"):
        verify(header, [frames[0], memoryview(bad), frames[2]])
    with pytest.raises(TransferError, match="truncated"):
        verify(header, frames[:2])
    with pytest.raises(TransferError, match="bytes"):
        verify(header, [frames[0], frames[1][:-8], frames[2]])
    with pytest.raises(TransferError, match="malformed"):
        KVHeader.decode(b"\x93not a header")


def test_block_runs_group_consecutive_blocks():
    """Frames are runs of consecutive pool blocks (the engine's KV seam builds them)."""
    from engine.kv_cache import block_runs

    assert block_runs([4, 5, 6, 9, 10, 2], max_blocks=8) == [(4, 3), (9, 2), (2, 1)]
    assert block_runs([1, 2, 3, 4, 5], max_blocks=2) == [(1, 2), (3, 2), (5, 1)]


def test_handle_state_only_moves_forward():
    h = TransferHandle("r", "d", 0, time.monotonic() + 1)
    h.advance(TransferState.SENT)
    h.advance(TransferState.PENDING)
    assert h.state is TransferState.SENT
    h.advance(TransferState.FAILED, "boom")
    h.advance(TransferState.DONE)
    assert h.state is TransferState.FAILED and h.error == "boom"


def _serve(receiver, stop, check=verify, seen=None):
    while not stop.is_set():
        for rx in receiver.poll(0.02):
            try:
                if rx.error:  # a streaming receiver already found a problem
                    raise TransferError(rx.error)
                check(rx.header, rx.frames)
                if seen is not None:
                    seen.append([bytes(f) for f in rx.frames])
                rx.ack(True)
            except TransferError as e:
                rx.ack(False, str(e))


def _wait(sender, handle, timeout=10):
    end = time.monotonic() + timeout
    while not handle.done and time.monotonic() < end:
        sender.poll()
        time.sleep(0.001)
    return handle


@pytest.mark.parametrize("transport", ["zmq", "grpc", "fake"])
def test_transport_end_to_end(transport):
    rx = make_receiver(transport, host="127.0.0.1")
    tx = make_sender(transport)
    stop = threading.Event()
    seen: list = []
    t = threading.Thread(target=_serve, args=(rx, stop, verify, seen), daemon=True)
    t.start()
    try:
        header, frames = make_payload(n_frames=4, blocks=3, block_nbytes=1 << 20)  # 12 MiB: several gRPC chunks
        h = _wait(tx, tx.send(rx.address, header, frames, timeout_s=10))
        assert h.state is TransferState.DONE, h.error
        assert seen[0] == [bytes(f) for f in frames]
        # A corrupt frame is refused and the sender learns why.
        bad = bytearray(frames[0])
        bad[5] ^= 1
        header2 = KVHeader.decode(header.encode())
        header2.request_id = "req-2"
        h2 = _wait(tx, tx.send(rx.address, header2, [memoryview(bad), *frames[1:]], timeout_s=10))
        assert h2.state is TransferState.FAILED and "checksum" in h2.error
    finally:
        stop.set()
        t.join()
        tx.close()
        rx.close()


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_unacknowledged_transfer_times_out(transport):
    rx = make_receiver(transport, host="127.0.0.1")  # nobody polls it: no ack ever comes
    tx = make_sender(transport)
    try:
        header, frames = make_payload()
        if transport == "grpc":
            rx.ack_timeout_s = 5.0
        h = _wait(tx, tx.send(rx.address, header, frames, timeout_s=0.5))
        assert h.state is TransferState.FAILED
    finally:
        tx.close()
        rx.close()


class RecordingSink:
    def __init__(self) -> None:
        self.opened, self.frames = [], []

    def open(self, header) -> None:
        if header.meta.get("refuse"):
            raise TransferError("refused by the sink")
        self.opened.append(header.request_id)

    def frame(self, header, index, buf) -> None:
        self.frames.append((header.request_id, index, bytes(buf)))


@pytest.mark.parametrize("transport,block_nbytes", [("zmq", 8192), ("grpc", 8192),
                                                     ("grpc", 5 << 20)])  # frames over one gRPC chunk
def test_frames_stream_into_a_sink(transport, block_nbytes):
    sink = RecordingSink()
    rx = make_receiver(transport, host="127.0.0.1", sink=sink)
    tx = make_sender(transport)
    try:
        header, frames = make_payload(n_frames=5 if block_nbytes < (1 << 20) else 2, blocks=1,
                                      block_nbytes=block_nbytes)
        for info in header.frames:
            info.checksum = 0  # the sender hashes each frame as it goes out
        h = tx.send(rx.address, header, frames, timeout_s=10)
        got = []
        while not got:
            got = rx.poll(0.05)
        assert got[0].landed and not got[0].error and got[0].frames == []
        assert sink.opened == ["req-1"]
        assert [(i, b) for _, i, b in sink.frames] == [(i, bytes(f)) for i, f in enumerate(frames)]
        got[0].ack(True)
        assert _wait(tx, h).state is TransferState.DONE
        # A refused header: the sink sees no frames and the sender learns why.
        header2, frames2 = make_payload(n_frames=2, blocks=1, block_nbytes=8192)
        header2.request_id, header2.meta["refuse"] = "req-2", True
        h2 = tx.send(rx.address, header2, frames2, timeout_s=10)
        got = []
        while not got:
            got = rx.poll(0.05)
        assert got[0].error == "refused by the sink" and all(r != "req-2" for r, _, _ in sink.frames)
        got[0].ack(False, got[0].error)
        assert _wait(tx, h2).state is TransferState.FAILED and "refused" in h2.error
        # A corrupt frame never reaches the sink; the transfer fails with the reason.
        header3, frames3 = make_payload(n_frames=2, blocks=1, block_nbytes=8192, seed=3)
        header3.request_id = "req-3"
        bad = bytearray(frames3[1])
        bad[7] ^= 1
        h3 = tx.send(rx.address, header3, [frames3[0], memoryview(bad)], timeout_s=10)
        got = []
        while not got:
            got = rx.poll(0.05)
        assert "checksum" in got[0].error and [i for r, i, _ in sink.frames if r == "req-3"] == [0]
        got[0].ack(False, got[0].error)
        assert _wait(tx, h3).state is TransferState.FAILED
    finally:
        tx.close()
        rx.close()


def _pump(sender, handle, rx, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not handle.done and time.monotonic() < end:
        sender.poll()
        for item in rx.poll(0.01):
            item.ack(True)


def test_socket_to_a_vanished_peer_is_closed():
    rx = make_receiver("zmq", host="127.0.0.1")
    sender = make_sender("zmq")
    try:
        header, frames = make_payload()
        h = sender.send(rx.address, header, frames, timeout_s=10)
        _pump(sender, h, rx)
        assert h.state is TransferState.DONE and sender.num_sockets == 1
        rx.close()  # the decode worker is gone
        end = time.monotonic() + 5
        while sender.num_sockets and time.monotonic() < end:
            sender.poll()
            time.sleep(0.05)
        assert sender.num_sockets == 0, "the socket to a vanished peer must be closed"
    finally:
        sender.close()


def _ack_while_polling(rx, sock, timeout: float = 3.0) -> dict:
    """Poll the receiver (it answers only while polled) until `sock` gets an acknowledgement: waiting
    on the socket alone would race the receiver's processing of the last header."""
    import msgpack
    import zmq

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rx.poll(0.02)
        try:
            return msgpack.unpackb(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            continue
    raise AssertionError("no acknowledgement came")


def test_partial_transfers_expire_and_are_bounded():
    import zmq

    from transfer.zmq_receiver import ZmqReceiver
    from transfer.zmq_transport import HEADER

    rx = ZmqReceiver(host="127.0.0.1", partial_timeout_s=0.5, max_partial=2)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 3000)  # a missing ack fails the test instead of hanging it
    sock.connect(rx.address)
    try:
        for i in range(3):  # headers never followed by their frames
            header, _ = make_payload()
            header.request_id, header.transfer_id = f"r{i}", f"t{i}"
            sock.send_multipart([HEADER, header.encode(), b""])  # no tag: this receiver checks none
        acks = [_ack_while_polling(rx, sock)]  # the third header's refusal
        assert rx.num_partial == 2  # the third was refused: at most two held
        import msgpack

        assert not acks[0]["ok"] and "receiver busy" in acks[0]["err"]
        time.sleep(0.6)
        rx.poll(0.05)
        assert rx.num_partial == 0  # expired with the transfer timeout
        expired = [msgpack.unpackb(sock.recv()) for _ in range(2)]
        assert all(not a["ok"] and "stopped coming" in a["err"] for a in expired)
    finally:
        sock.close(linger=0)
        ctx.term()
        rx.close()


def test_zmq_frames_must_carry_the_transfer_keys_tag():
    """A header signed with the reservation's key opens the transfer; frames whose tag is not under
    that key (someone who guessed the transfer id) are dropped without counting or landing, and the
    key holder's frames still complete it."""
    import zmq

    from transfer.wire import frame_tag, header_tag
    from transfer.zmq_transport import FRAME, HEADER, INDEX

    key = b"k" * 32
    sink = RecordingSink()
    rx = make_receiver("zmq", host="127.0.0.1", sink=sink, keys=lambda h: key)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(rx.address)
    try:
        header, frames = make_payload(n_frames=2, blocks=1, block_nbytes=8192)
        header.transfer_id = tid = "t-1"
        raw = header.encode()
        sock.send_multipart([HEADER, raw, header_tag(key, raw)])
        for i, f in enumerate(frames):  # checksums right, tags under another key
            digest = header.frames[i].checksum
            sock.send_multipart([FRAME, tid.encode(), INDEX.pack(i, digest), frame_tag(b"x" * 32, tid, i, digest), f])
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert not rx.poll(0.05)
        assert sink.opened == ["req-1"] and sink.frames == [] and rx.num_partial == 1
        for i, f in enumerate(frames):
            digest = header.frames[i].checksum
            sock.send_multipart([FRAME, tid.encode(), INDEX.pack(i, digest), frame_tag(key, tid, i, digest), f])
        got = []
        while not got:
            got = rx.poll(0.05)
        assert not got[0].error and [i for _, i, _ in sink.frames] == [0, 1]
    finally:
        sock.close(linger=0)
        ctx.term()
        rx.close()


def test_transfers_per_peer_are_bounded():
    """One sender cannot take all of a receiver's room: its transfers beyond max_per_peer are refused
    while another sender's is still taken."""
    import zmq

    from transfer.zmq_receiver import ZmqReceiver
    from transfer.zmq_transport import HEADER

    rx = ZmqReceiver(host="127.0.0.1", max_partial=16, max_per_peer=2)
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
    try:
        for n, sock in enumerate(socks):
            sock.setsockopt(zmq.RCVTIMEO, 3000)
            sock.connect(rx.address)
            for i in range(3 if n == 0 else 1):
                header, _ = make_payload()
                header.request_id, header.transfer_id = f"r{n}-{i}", f"t{n}-{i}"
                sock.send_multipart([HEADER, header.encode(), b""])
        ack = _ack_while_polling(rx, socks[0])
        end = time.monotonic() + 2
        while rx.num_partial < 3 and time.monotonic() < end:  # the second sender's header may come later
            rx.poll(0.05)
        assert rx.num_partial == 3  # two of the first sender's, one of the second's
        assert not ack["ok"] and ack["tid"] == "t0-2" and "this sender already has 2" in ack["err"]
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        rx.close()


def test_decoders_have_limits():
    """A header or a frame far beyond what pdserve sends is refused before it is held (#9, item 5)."""
    import zmq

    from transfer.wire import MAX_HEADER_BYTES
    from transfer.zmq_receiver import ZmqReceiver
    from transfer.zmq_transport import FRAME, HEADER

    with pytest.raises(TransferError, match="exceeds"):
        KVHeader.decode(b"\x00" * (MAX_HEADER_BYTES + 1))
    import msgpack

    with pytest.raises(TransferError, match="malformed"):
        KVHeader.decode(msgpack.packb({"v": 1, "rid": "x" * (1 << 17)}))  # a 128 KiB string field
    rx = ZmqReceiver(host="127.0.0.1", max_message_bytes=1 << 20)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(rx.address)
    try:
        header, frames = make_payload(n_frames=1, blocks=1, block_nbytes=4 << 20)  # one 4 MiB frame
        header.transfer_id = "big"
        sock.send_multipart([HEADER, header.encode(), b""])
        sock.send_multipart([FRAME, b"big", b"\x00" * 12, b"", frames[0]])
        end = time.monotonic() + 1.5
        got = []
        while time.monotonic() < end:
            got += rx.poll(0.05)
        assert not got and rx.num_partial == 1  # the header is held, the oversized frame never arrived
    finally:
        sock.close(linger=0)
        ctx.term()
        rx.close()


def test_several_transfers_to_a_silent_peer_all_time_out():
    """The first timeout closes the socket to that peer and fails the others to it; polling on
    must not trip over the transfers that closing already settled."""
    rx = make_receiver("zmq", host="127.0.0.1")  # nobody polls it: no ack ever comes
    sender = make_sender("zmq")
    try:
        handles = []
        for i in range(3):
            header, frames = make_payload()
            header.request_id = f"silent-{i}"
            handles.append(sender.send(rx.address, header, frames, timeout_s=0.2))
        end = time.monotonic() + 5
        while not all(h.done for h in handles) and time.monotonic() < end:
            sender.poll()
            time.sleep(0.02)
        assert all(h.state is TransferState.FAILED for h in handles)
        assert sender.num_sockets == 0
    finally:
        sender.close()
        rx.close()


def test_zmq_first_frame_rides_with_the_header():
    """A transfer of n frames is n messages, the first carrying the header: a short prompt's KV
    (one frame) goes in one message. A receiver still takes a header alone, then every frame."""
    import zmq

    from transfer.zmq_receiver import ZmqReceiver
    from transfer.zmq_sender import ZmqSender
    from transfer.zmq_transport import FRAME, HEADER

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, 3000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tx = ZmqSender()
    try:
        header, frames = make_payload(n_frames=2)
        tx.send(f"tcp://127.0.0.1:{port}", header, frames, timeout_s=5)
        first, second = router.recv_multipart(), router.recv_multipart()
        assert first[1] == HEADER and len(first) == 7 and bytes(first[6]) == bytes(frames[0])
        assert second[1] == FRAME and len(second) == 6 and bytes(second[5]) == bytes(frames[1])
    finally:
        tx.close()
        router.close(linger=0)
        ctx.term()
    rx, tx = ZmqReceiver(host="127.0.0.1"), ZmqSender()
    try:
        header, frames = make_payload(n_frames=1)
        handle = tx.send(rx.address, header, frames, timeout_s=5)
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = rx.poll(0.05)
        assert len(got) == 1 and not got[0].error and bytes(got[0].frames[0]) == bytes(frames[0])
        got[0].ack(True)
        while not handle.done and time.monotonic() < deadline:
            rx.poll(0.01)
            tx.poll()
        assert handle.state is TransferState.DONE
    finally:
        tx.close()
        rx.close()


def test_grpc_sends_a_one_chunk_kv_as_one_message_and_a_larger_header_ahead():
    from transfer.grpc_transport import CHUNK, FRAME_PREFIX, kv_messages, parse_opening
    from transfer.wire import checksum, frame_tag

    header, frames = make_payload()
    key = b"k" * 32
    (only,) = list(kv_messages(header, frames, key=key))  # header, tag and all frames together
    rest = parse_opening(only)[2]
    for i, f in enumerate(frames):  # each frame after its index, digest and tag
        index, digest, tlen = FRAME_PREFIX.unpack_from(rest)
        tag, rest = bytes(rest[FRAME_PREFIX.size:FRAME_PREFIX.size + tlen]), rest[FRAME_PREFIX.size + tlen:]
        assert (index, digest, tag) == (i, checksum(f), frame_tag(key, header.transfer_id, i, digest))
        assert bytes(rest[:f.nbytes]) == bytes(f)
        rest = rest[f.nbytes:]
    assert rest.nbytes == 0
    big, big_frames = make_payload(n_frames=2, blocks=1, block_nbytes=CHUNK)
    msgs = list(kv_messages(big, big_frames, key=None))
    assert len(msgs) == 3 and len(msgs[0]) < 4096 and [len(m) for m in msgs[1:]] == [CHUNK + FRAME_PREFIX.size] * 2
    # Through a receiver: both shapes land frame by frame, equal to what was sent.
    sink = RecordingSink()
    rx = make_receiver("grpc", host="127.0.0.1", sink=sink)
    tx = make_sender("grpc")
    try:
        for h, fs in ((header, frames), (big, big_frames)):
            handle = tx.send(rx.address, h, fs, timeout_s=10)
            got = []
            while not got:
                got = rx.poll(0.05)
            assert got[0].landed and not got[0].error
            got[0].ack(True)
            assert _wait(tx, handle).state is TransferState.DONE
        assert [b for _, _, b in sink.frames] == [bytes(f) for f in (*frames, *big_frames)]
    finally:
        tx.close()
        rx.close()


def _kv_transfer_server(lane, stream):
    """A plain gRPC server offering the transport's two methods with the given handlers. Each lane
    is greeted only after a KV has come as a stream: the KV that opens a lane goes as a stream
    while the lane is not open, but a greeting quick enough (the test's thread descheduled between
    opening the lane and sending) would rightly take that KV on the lane instead."""
    import threading
    from concurrent import futures

    import grpc

    from transfer.grpc_transport import OPTIONS, SERVICE

    pushes = threading.Semaphore(0)

    def lane_after_a_push(messages, context):
        pushes.acquire(timeout=10)
        yield from lane(messages, context)

    def push(chunks, context):
        try:
            return stream(chunks, context)
        finally:
            pushes.release()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Lane": grpc.stream_stream_rpc_method_handler(lane_after_a_push),
        "Push": grpc.stream_unary_rpc_method_handler(push)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"grpc://127.0.0.1:{port}"


def _lane_ack(seq: int) -> bytes:
    """A plain lane handler's "ok" for the message numbered `seq`, as the receiver frames it."""
    import msgpack

    return struct.pack("<Q", seq) + msgpack.packb({"ok": True})


def _drain_ok(chunks, context) -> bytes:
    """A plain Push handler: read the stream, answer "ok"."""
    import msgpack

    list(chunks)
    return msgpack.packb({"ok": True})


def _open_lane(tx, address, rx=None, timeout=5.0):
    """Send one KV (it goes as a stream and opens the lane; acked here when `rx` is given), then
    wait until the lane is open."""
    handle = tx.send(address, *make_payload(seed=50), timeout_s=10)
    end = time.monotonic() + timeout
    while rx is not None and not handle.done and time.monotonic() < end:
        for item in rx.poll(0.01):
            item.ack(True)
        tx.poll()
    assert _wait(tx, handle).state is TransferState.DONE
    lane = tx.lanes[address.removeprefix("grpc://")]
    end = time.monotonic() + timeout
    while not lane.ready and time.monotonic() < end:
        time.sleep(0.01)
    assert lane.ready
    return lane


def test_grpc_lane_carries_kv_of_any_size_and_a_bulk_kv_alone():
    """Which method carries what, seen by a plain gRPC server: while the lane opens, a KV goes as
    a stream; once the server has greeted the lane, KV go on it, each as its own messages (one
    for a one-chunk KV, the opening and then the frames for a larger one), acknowledged by
    sequence number. While a bulk KV's answer is outstanding, nothing else takes the lane: a
    small KV sent meanwhile goes as a stream, and takes the lane again once the bulk one is done.
    A KV beyond the sender's lane_max_bytes goes as a stream, the lane idle or not."""
    import threading

    import msgpack

    from transfer.grpc_sender import GrpcSender
    from transfer.grpc_transport import CHUNK, messages_after_opening, parse_opening
    from transfer.wire import KVHeader

    seen, release = [], threading.Event()

    def lane(messages, context):
        yield b""  # the greeting: the lane is open
        for seq, first in enumerate(messages):
            raw, _, rest = parse_opening(first)
            more = messages_after_opening(KVHeader.decode(raw))
            size = len(rest) + sum(len(next(messages)) for _ in range(more))
            seen.append(("Lane", 1 + more, size))
            if more:
                release.wait(10)  # the bulk KV's answer waits
            yield _lane_ack(seq)

    def stream(chunks, context):
        seen.append(("Push", None, sum(len(c) for c in chunks)))
        return msgpack.packb({"ok": True})

    server, address = _kv_transfer_server(lane, stream)
    tx = GrpcSender(lane_max_bytes=2 * CHUNK)
    try:
        _open_lane(tx, address)
        small, small_frames = make_payload()
        big, big_frames = make_payload(n_frames=2, blocks=1, block_nbytes=CHUNK)
        huge, huge_frames = make_payload(n_frames=2, blocks=1, block_nbytes=CHUNK + 1)
        assert _wait(tx, tx.send(address, small, small_frames, timeout_s=10)).state is TransferState.DONE
        bulk = tx.send(address, big, big_frames, timeout_s=10)
        assert _wait(tx, tx.send(address, small, small_frames, timeout_s=10)).state is TransferState.DONE
        release.set()
        assert _wait(tx, bulk).state is TransferState.DONE
        assert _wait(tx, tx.send(address, small, small_frames, timeout_s=10)).state is TransferState.DONE
        assert _wait(tx, tx.send(address, huge, huge_frames, timeout_s=10)).state is TransferState.DONE
        assert len(seen) == 6 and seen[0][0] == "Push" and seen[5][:2] == ("Push", None)
        assert seen[1][:2] == seen[4][:2] == ("Lane", 1)  # a one-chunk KV: one message
        meanwhile = {method: (n, size) for method, n, size in seen[2:4]}  # the bulk KV and the small one
        assert meanwhile["Lane"][0] == 3 and "Push" in meanwhile  # the opening, then a message a frame
        assert meanwhile["Lane"][1] > big.total_bytes  # both frames, each after its prefix
        assert seen[1][2] > small.total_bytes  # every frame, each after its prefix
    finally:
        release.set()
        tx.close()
        server.stop(0)


def test_grpc_bulk_kv_lands_on_the_lane_and_the_lane_goes_on():
    """A real receiver reads a bulk KV off the lane, exactly its own messages, lands it, and the
    KV behind it on the same lane arrives whole too."""
    from transfer.grpc_transport import CHUNK

    sink = RecordingSink()
    rx = make_receiver("grpc", host="127.0.0.1", sink=sink)
    tx = make_sender("grpc")
    try:
        lane = _open_lane(tx, rx.address, rx)
        sink.frames.clear()
        big, big_frames = make_payload(n_frames=3, blocks=1, block_nbytes=CHUNK + 4096)
        small, small_frames = make_payload(seed=7)
        small.request_id = "req-small"
        for h, fs in ((big, big_frames), (small, small_frames)):
            handle = tx.send(rx.address, h, fs, timeout_s=10)
            end = time.monotonic() + 5
            while not handle.done and time.monotonic() < end:
                for item in rx.poll(0.01):
                    assert not item.error
                    item.ack(True)
                tx.poll()
            assert handle.state is TransferState.DONE
        assert [b for _, _, b in sink.frames] == [bytes(f) for f in (*big_frames, *small_frames)]
        assert tx.lanes[rx.address.removeprefix("grpc://")] is lane and not lane.dead
        assert rx.lanes.open == 1
    finally:
        tx.close()
        rx.close()


def test_grpc_lane_lands_the_next_kv_before_the_owner_acks_the_first():
    """The receiver does not hold a lane's next KV until the owner has acked the one before: both
    reach the owner, which acks them in the other order, and each sender's handle gets its own."""
    sink = RecordingSink()
    rx = make_receiver("grpc", host="127.0.0.1", sink=sink)
    tx = make_sender("grpc")
    try:
        _open_lane(tx, rx.address, rx)
        a = tx.send(rx.address, *make_payload(seed=1), timeout_s=10)
        h2, f2 = make_payload(seed=2)
        h2.request_id = "req-2"
        b = tx.send(rx.address, h2, f2, timeout_s=10)
        items, end = [], time.monotonic() + 5
        while len(items) < 2 and time.monotonic() < end:
            items += rx.poll(0.05)
        assert [i.header.request_id for i in items] == ["req-1", "req-2"]  # both, neither acked yet
        items[1].ack(True)
        items[0].ack(False, "refused by the owner")
        assert _wait(tx, b).state is TransferState.DONE
        assert _wait(tx, a).state is TransferState.FAILED and "refused by the owner" in a.error
    finally:
        tx.close()
        rx.close()


def test_grpc_lane_fails_a_kv_its_receiver_chokes_on_and_the_next_kv_arrives():
    """An unexpected error while one KV is read fails that KV at once. Where that KV's messages
    end is then unknown, so the lane ends; the next KV arrives all the same."""
    class Choking(RecordingSink):
        def open(self, header) -> None:
            if header.request_id == "req-choke":
                raise RuntimeError("sink bug")
            super().open(header)

    rx = make_receiver("grpc", host="127.0.0.1", sink=Choking())
    tx = make_sender("grpc")
    try:
        lane = _open_lane(tx, rx.address, rx)
        bad, frames = make_payload(seed=1)
        bad.request_id = "req-choke"
        choked = _wait(tx, tx.send(rx.address, bad, frames, timeout_s=60), timeout=5)
        assert choked.state is TransferState.FAILED and "sink bug" in choked.error
        end = time.monotonic() + 5
        while not lane.dead and time.monotonic() < end:
            time.sleep(0.01)
        assert lane.dead
        after = tx.send(rx.address, *make_payload(seed=2), timeout_s=10)
        end = time.monotonic() + 5
        while not after.done and time.monotonic() < end:
            for item in rx.poll(0.01):
                item.ack(True)
            tx.poll()
        assert after.state is TransferState.DONE
    finally:
        tx.close()
        rx.close()


def test_grpc_receiver_refuses_lanes_beyond_its_limit_and_the_sender_calls_per_kv():
    """Each open lane holds one of the receiver's threads, so it serves `max_lanes`: a second
    sender's lane is refused, and its KV still arrive, each on a call of its own."""
    from transfer.grpc_receiver import GrpcReceiver

    rx = GrpcReceiver(host="127.0.0.1", sink=RecordingSink(), max_lanes=1)
    first, second = make_sender("grpc"), make_sender("grpc")
    stop = threading.Event()

    def owner() -> None:
        while not stop.is_set():
            for item in rx.poll(0.02):
                item.ack(True)

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    try:
        _open_lane(first, rx.address)
        for seed in range(4):
            assert _wait(second, second.send(rx.address, *make_payload(seed=seed), timeout_s=10)).state \
                is TransferState.DONE
            time.sleep(0.1)  # the refusal arrives
        assert rx.lanes.open == 1
        assert rx.lanes.refused == 1  # refused once, not tried again at every KV
    finally:
        stop.set()
        t.join()
        first.close()
        second.close()
        rx.close()


def test_grpc_lane_forgets_a_kv_the_sender_gave_up_on():
    """A KV whose ack never comes, abandoned or failed at its deadline (the sender's poll keeps
    it: a lane has no gRPC deadline per KV), no longer holds the lane busy: the lane can go idle
    and close."""

    def lane(messages, context):
        yield b""
        for seq, _ in enumerate(messages):
            if seq < 2:  # the first two are never answered
                continue
            yield _lane_ack(seq)

    server, address = _kv_transfer_server(lane, _drain_ok)
    tx = make_sender("grpc")
    try:
        lane_ = _open_lane(tx, address)
        abandoned = tx.send(address, *make_payload(seed=1), timeout_s=60)
        expired = tx.send(address, *make_payload(seed=2), timeout_s=0.1)
        time.sleep(0.2)
        tx.abandon(abandoned)
        tx.poll()
        assert expired.state is TransferState.FAILED and "timeout" in expired.error  # no grpc deadline on a lane
        assert lane_.idle(0.0)  # nothing waiting on it any more
        assert _wait(tx, tx.send(address, *make_payload(seed=3), timeout_s=10)).state is TransferState.DONE
    finally:
        tx.close()
        server.stop(0)


def test_grpc_bulk_kv_the_sender_gave_up_on_ends_its_lane():
    """A bulk KV cannot be taken back part-way, and nothing else is on the lane meanwhile: giving
    up on one ends the lane, and the next KV goes out all the same."""
    from transfer.grpc_transport import CHUNK, messages_after_opening, parse_opening
    from transfer.wire import KVHeader

    def lane(messages, context):
        yield b""
        for seq, first in enumerate(messages):
            more = messages_after_opening(KVHeader.decode(parse_opening(first)[0]))
            for _ in range(more):
                next(messages)
            if not more:  # a bulk KV is never answered
                yield _lane_ack(seq)

    server, address = _kv_transfer_server(lane, _drain_ok)
    tx = make_sender("grpc")
    try:
        lane_ = _open_lane(tx, address)
        bulk = tx.send(address, *make_payload(n_frames=2, blocks=1, block_nbytes=CHUNK), timeout_s=60)
        time.sleep(0.2)
        assert not bulk.done and lane_.send(iter(()), bulk=False) is None  # busy with the bulk KV
        tx.abandon(bulk)
        end = time.monotonic() + 5
        while not lane_.dead and time.monotonic() < end:
            time.sleep(0.01)
        assert lane_.dead
        assert _wait(tx, tx.send(address, *make_payload(seed=3), timeout_s=10)).state is TransferState.DONE
    finally:
        tx.close()
        server.stop(0)


def test_grpc_idle_lane_closes_and_the_next_kv_opens_it_again():
    """A lane holds a thread at each end, so one left idle closes (the receiver's count drops)."""
    from transfer.grpc_receiver import GrpcReceiver
    from transfer.grpc_sender import GrpcSender

    rx = GrpcReceiver(host="127.0.0.1", sink=RecordingSink())
    tx = GrpcSender(lane_idle_s=0.3)
    try:
        _open_lane(tx, rx.address, rx)
        assert rx.lanes.open == 1 and tx.num_sockets == 1  # what the worker's peer_sockets gauge shows
        end = time.monotonic() + 5
        while (tx.lanes or rx.lanes.open) and time.monotonic() < end:
            tx.poll()
            time.sleep(0.05)
        assert not tx.lanes and rx.lanes.open == 0 and tx.num_sockets == 0
        _open_lane(tx, rx.address, rx)
        assert rx.lanes.open == 1
    finally:
        tx.close()
        rx.close()


def test_grpc_receiver_lets_go_of_the_lane_of_a_sender_that_stops_answering():
    """A sender frozen with its lane open (SIGSTOP: the socket stays up and nothing answers, as
    when its host hangs or drops off the network, and no FIN comes) loses the lane at the
    receiver's keepalive, which gives the lane's server thread back; the kernel's TCP timeout
    would take hours."""
    import os
    import signal
    import subprocess
    import sys

    from transfer.grpc_receiver import GrpcReceiver
    from transfer.grpc_transport import METHOD_LANE

    rx = GrpcReceiver(host="127.0.0.1", sink=RecordingSink(), keepalive_s=0.5, keepalive_timeout_s=1.0)
    # The sender: a raw lane from a process of its own, greeted, then idle.
    script = (f"import queue, time, grpc\n"
              f"q = queue.SimpleQueue()\n"
              f"lane = grpc.insecure_channel('127.0.0.1:{rx.port}').stream_stream({METHOD_LANE!r})(iter(q.get, None))\n"
              f"next(lane)\nprint('greeted', flush=True)\ntime.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "greeted"
        assert rx.lanes.open == 1
        os.kill(child.pid, signal.SIGSTOP)
        end = time.monotonic() + 15
        while rx.lanes.open and time.monotonic() < end:
            time.sleep(0.05)
        assert rx.lanes.open == 0
    finally:
        child.kill()  # a stopped process dies of SIGKILL too
        child.wait(10)
        rx.close()


def test_grpc_kv_on_a_lane_that_breaks_fails_at_once_and_the_next_opens_a_new_lane():
    """A lane that ends under a KV fails it now, not at its deadline; the next KV finds no lane,
    goes as a stream and opens another."""
    lanes = []

    def lane(messages, context):
        lanes.append(context)
        yield b""
        if len(lanes) == 1:  # the first lane: acks its first KV, then ends under the second
            next(messages)
            yield _lane_ack(0)
            next(messages)
            return
        for seq, _ in enumerate(messages):
            yield _lane_ack(seq)

    server, address = _kv_transfer_server(lane, _drain_ok)
    tx = make_sender("grpc")
    try:
        _open_lane(tx, address)
        assert _wait(tx, tx.send(address, *make_payload(seed=1), timeout_s=10)).state is TransferState.DONE
        started = time.monotonic()
        broken = _wait(tx, tx.send(address, *make_payload(seed=2), timeout_s=60), timeout=5)
        assert broken.state is TransferState.FAILED and "closed the lane" in broken.error
        assert time.monotonic() - started < 5
        _open_lane(tx, address)  # a stream, then a second lane
        assert _wait(tx, tx.send(address, *make_payload(seed=3), timeout_s=10)).state is TransferState.DONE
        assert len(lanes) == 2
    finally:
        tx.close()
        server.stop(0)


def test_grpc_hashes_each_frame_when_its_turn_comes():
    """A larger KV's digests are not all computed before its first byte leaves: each frame is
    hashed as it is cut into chunks (its prefix carries the digest of the bytes sent then)."""
    from transfer.grpc_transport import CHUNK, FRAME_PREFIX, kv_messages
    from transfer.wire import checksum

    header, frames = make_payload(n_frames=2, blocks=1, block_nbytes=CHUNK)
    for info in header.frames:  # as the prefill worker packs a KV: digests left to the transport
        info.checksum = 0
    second = bytearray(frames[1])
    original = bytes(second)
    frames = [frames[0], memoryview(second)]
    msgs = kv_messages(header, frames, key=None)
    next(msgs), next(msgs)  # the opening and the first frame are on their way
    second[:8] = b"changed!"  # what the second frame holds by the time its turn comes
    _, digest, _ = FRAME_PREFIX.unpack_from(next(msgs))
    assert digest == checksum(bytes(second)) != checksum(original)


def test_grpc_frame_not_signed_with_the_reservation_key_is_refused():
    import grpc
    import msgpack

    from transfer.grpc_transport import FRAME_PREFIX, METHOD_LANE, OPENING, kv_messages

    key = b"k" * 32
    rx = make_receiver("grpc", host="127.0.0.1", keys=lambda h: key)
    try:
        with grpc.insecure_channel(rx.address.removeprefix("grpc://")) as ch:
            header, frames = make_payload()
            good = next(kv_messages(header, frames, key))
            hlen, tlen = OPENING.unpack_from(good)
            at = OPENING.size + hlen + tlen + FRAME_PREFIX.size  # the first frame's tag
            bad = bytearray(good)
            bad[at] ^= 0xFF
            replies = ch.stream_stream(METHOD_LANE)(iter([bytes(bad)]), timeout=10)
            assert next(replies) == b""  # the lane's greeting
            reply = next(replies)
            ack = msgpack.unpackb(reply[8:])
            assert reply[:8] == bytes(8) and not ack["ok"] and "not signed" in ack["err"]
            assert rx.poll(0.1) == []  # refused before it reached the owner
    finally:
        rx.close()


def test_grpc_opening_that_misstates_its_lengths_is_refused():
    import grpc
    import msgpack

    from transfer.grpc_transport import METHOD, METHOD_LANE

    rx = make_receiver("grpc", host="127.0.0.1")
    try:
        with grpc.insecure_channel(rx.address.removeprefix("grpc://")) as ch:
            stream = ch.stream_unary(METHOD)

            def unary(message: bytes, timeout: float) -> bytes:  # one message on a lane of its own
                replies = ch.stream_stream(METHOD_LANE)(iter([message]), timeout=timeout)
                assert next(replies) == b""
                return next(replies)[8:]

            header, frames = make_payload()
            raw = header.encode()
            short = struct.pack("<II", len(raw), 0) + raw + bytes(frames[0])  # frames 1 and 2 missing
            for first in (b"\x01\x00", struct.pack("<II", 1 << 30, 32) + bytes(64),
                          struct.pack("<II", 10, 32) + bytes(20)):
                for ack in (stream(iter([first]), timeout=10), unary(first, timeout=10)):
                    ack = msgpack.unpackb(ack)
                    assert not ack["ok"] and "opening" in ack["err"]
            for ack in (stream(iter([short]), timeout=10), unary(short, timeout=10)):  # a frame with no prefix
                ack = msgpack.unpackb(ack)
                assert not ack["ok"] and ("was due" in ack["err"] or "truncated" in ack["err"])
            # A lane's message must hold every frame: nothing can follow it.
            ack = msgpack.unpackb(unary(struct.pack("<II", len(raw), 0) + raw, timeout=10))
            assert not ack["ok"] and "truncated" in ack["err"]
        assert rx.poll(0.1) == []  # nothing reached the owner
    finally:
        rx.close()


def test_grpc_reads_a_larger_kvs_chunks_ahead_within_its_depth_and_ends_with_the_call():
    """The receiver's read-ahead: while one chunk is checked and landed, the next `depth` are
    already asked of gRPC, no more; an error reaches the reader; the thread ends every way."""
    from transfer.grpc_receiver import _read_ahead

    pulled = []

    def source(n, fail=False):
        for i in range(n):
            pulled.append(i)
            yield b"%d" % i
        if fail:
            raise RuntimeError("call cancelled")

    def until(cond):
        end = time.monotonic() + 5
        while not cond() and time.monotonic() < end:
            time.sleep(0.01)

    it = _read_ahead(source(10), depth=2)
    assert next(it) == b"0"
    until(lambda: len(pulled) >= 3)  # the read-ahead thread takes what it has room for
    time.sleep(0.1)
    assert pulled == [0, 1, 2]  # the one handed over and two ahead, no more
    assert list(it) == [b"%d" % i for i in range(1, 10)]
    with pytest.raises(RuntimeError, match="cancelled"):
        list(_read_ahead(source(3, fail=True)))
    early = _read_ahead(source(10))
    next(early)
    until(lambda: len(pulled) >= 13 + 3)  # its thread has filled the room and waits for more
    early.close()  # the reader gave up (a refused frame): the thread must not wait on
    until(lambda: not [t for t in threading.enumerate() if t.name == "kv-grpc-read-ahead"])
    assert not [t for t in threading.enumerate() if t.name == "kv-grpc-read-ahead"]
