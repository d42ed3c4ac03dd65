"""gRPC transport for deployments that open only gRPC ports.

A call per transfer on a generic method, or a message on a lane (below); messages are raw bytes
(no protobuf around bulk data). The first holds the lengths of the msgpack header and of its tag
under the reservation's transfer key, then both, then, when the KV fits one chunk, all its
frames; otherwise chunks of the frames follow. The reply is the msgpack acknowledgement. Under
mtls the call runs over TLS with the cluster's certificates (passed in as plain grpc credentials).

Each frame comes after its index, xxh3 digest and tag (wire.frame_tag), hashed as it is cut into
chunks, as on ZeroMQ. With every digest in the header instead, the sender hashed the whole KV
before its first byte left (256 MiB: ~9 ms here). The header's tag is checked before any frame is
read, and a frame's before its bytes are.

A KV of one chunk is one message each way: against three (header, tag, chunk), a 1 MiB transfer
took 7-12% less time (paired, one process pair). Between a sender and a receiver a KV goes on a
lane (transfer/grpc_lane.py), one bidirectional call kept open, which saves each KV the cost of a
call of its own; until the lane is open, or while it carries a larger KV, a transfer is one
client-streaming call. bench/transfer.py, 1 MiB, against a raw client stream of the same bytes
sent beside it: 0.89-1.04 (thirteen runs, security off and token) where a call per KV read
0.63-0.81. Larger KV, the same KV on the lane or on a call of its own, in turns in one
process: the lane took 0.94x the time at 8 MiB and 0.97-1.00x at 16 MiB, and was slower beyond
(grpc_lane.LANE_MAX_BYTES).

Tried before lanes: a blocking unary call per one-chunk KV, on a pool of the sender's threads
(as `.future()` from the sender thread it took 1.4-1.55x as long), was 1.21-1.31x the stream's
throughput; larger KV sent as blocking streams gained nothing measurable.

The message format and constants both ends share live here; the sender is
transfer/grpc_sender.py and the receiver transfer/grpc_receiver.py."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

from transfer.wire import KVHeader, TransferError, checksum, frame_tag, header_tag

# The service's name carries the wire's generation: a sender and a receiver of different ones
# (a cluster half upgraded) meet UNIMPLEMENTED, not frames they misread. 2: per-frame digests;
# 3: lanes for one-chunk KV (the unary PushOne gone); 4: KV of any size on a lane.
SERVICE = "pdserve.kv4.KVTransfer"
METHOD = f"/{SERVICE}/Push"  # client-streaming: one KV (of any size)
METHOD_LANE = f"/{SERVICE}/Lane"  # bidirectional: many KV, one after another (grpc_lane)
CHUNK = 4 << 20
OPTIONS = [("grpc.max_receive_message_length", 2 * CHUNK), ("grpc.max_send_message_length", 2 * CHUNK)]
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 60.0, 20.0  # the receiver pings a connection silent this long
OPENING = struct.Struct("<II")  # the first message's header and tag lengths
FRAME_PREFIX = struct.Struct("<IQB")  # before each frame: its index, xxh3 digest and tag length
MAX_TAG_BYTES = 64
MAX_HEADER_BYTES = 1 << 20  # a longer header is refused before it is decoded


def server_keepalive(every_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """A ping after `every_s` without traffic on a connection with a call open, and the connection
    closed when `timeout_s` passes unanswered. grpcio (1.85) times the ping by
    `grpc.http2.ping_timeout_ms`, whose default is a minute, and not by `keepalive_timeout_ms`
    (grpc/grpc#39239): with only the latter set, a frozen sender held its lane 61 s past a 1 s
    ping. Both are set, for versions that honour either."""
    every, timeout = round(every_s * 1000), round(timeout_s * 1000)
    return [("grpc.keepalive_time_ms", every), ("grpc.keepalive_timeout_ms", timeout),
            ("grpc.http2.ping_timeout_ms", timeout)]


def kv_messages(header: KVHeader, frames: Sequence[memoryview], key: bytes | None) -> Iterator[bytes]:
    """The call's messages: the opening (lengths, header, tag, and all frames when they fit one
    chunk), then the frames in chunks of at most CHUNK bytes, each within one frame, a frame's
    first chunk led by its prefix (frame_prefix). Every byte is copied once, as gRPC takes only bytes.
    A larger KV's header goes ahead alone, so that the receiver checks it while the first chunk
    is on the wire; each frame is hashed only when its turn comes (on grpcio's thread that
    drains this generator), so hashing overlaps the wire."""
    raw = header.encode()
    tag = header_tag(key, raw)
    views = [memoryview(f).cast("B") for f in frames]
    opening = [OPENING.pack(len(raw), len(tag)), raw, tag]
    if not messages_after_opening(header):  # the receiver counts the messages by the same rule
        for i, mv in enumerate(views):
            opening += [frame_prefix(header, i, mv, key), mv]
        yield b"".join(opening)
        return
    yield b"".join(opening)
    for i, mv in enumerate(views):
        yield b"".join((frame_prefix(header, i, mv, key), mv[:CHUNK]))
        for j in range(CHUNK, mv.nbytes, CHUNK):
            yield bytes(mv[j:j + CHUNK])


def frame_prefix(header: KVHeader, index: int, frame: memoryview, key: bytes | None) -> bytes:
    """A frame's index, digest (the header's when it has one) and tag."""
    digest = header.frames[index].checksum or checksum(frame)
    tag = frame_tag(key, header.transfer_id, index, digest)
    return FRAME_PREFIX.pack(index, digest, len(tag)) + tag


def parse_opening(first: bytes) -> tuple[bytes, bytes, memoryview]:
    """The first message's header, tag and the frame bytes after them."""
    if len(first) < OPENING.size:
        raise TransferError("transfer opening shorter than its length prefix")
    hlen, tlen = OPENING.unpack_from(first)
    end = OPENING.size + hlen + tlen
    if hlen > MAX_HEADER_BYTES or end > len(first):
        raise TransferError(f"transfer opening announces a {hlen}-byte header and a {tlen}-byte tag in "
                            f"{len(first)} bytes")
    view = memoryview(first)
    return bytes(view[OPENING.size:OPENING.size + hlen]), bytes(view[OPENING.size + hlen:end]), view[end:]


def messages_after_opening(header: KVHeader) -> int:
    """How many messages follow a KV's opening (kv_messages): none when it fits one chunk, else each
    frame's bytes in chunks of CHUNK (at least one message a frame, for its prefix)."""
    if header.total_bytes <= CHUNK:
        return 0
    return sum(max(1, -(-f.nbytes // CHUNK)) for f in header.frames)
