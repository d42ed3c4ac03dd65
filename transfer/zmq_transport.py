"""ZeroMQ transport (the default): DEALER -> ROUTER, header frame + zero-copy data frames,
acknowledgement back on the same socket pair.

Messages: [H, header, tag] opens a transfer; [F, transfer id, (index, xxh3), tag, bytes] carries
one frame. The sender puts the first frame's three parts in the header's message, [H, header,
tag, (index, xxh3), tag, bytes]: a transfer of one frame (a short prompt's KV) is then one
message each way, where a message more cost ~0.15 ms of wake-ups on both ends of a 1 ms transfer.
With a key lookup the receiver checks each tag (wire.header_tag / frame_tag) before
the message may touch anything, so KV that is not signed with its reservation's one-time key is
refused without landing, and cannot fail the reservation either. Opt-in CURVE encrypts the
connection (the receiver's public key travels with the worker's registration).

On one host, frames inside memory the sender shares (`share`: the prefill worker's KV pool) go
as references into it once the receiver has said it can map that memory: see
transfer/shared_memory.py. The messages, checks and acknowledgements are the same.

Constants and message parts both ends share live here; the sender is transfer/zmq_sender.py and
the receiver transfer/zmq_receiver.py."""

from __future__ import annotations

import struct

DEFAULT_HWM = 1024  # messages queued per peer before senders block: bounds memory held by ZeroMQ
HEADER, FRAME = b"H", b"F"  # a transfer is one header message, then one message per frame
INDEX = struct.Struct("<IQ")  # a frame's index and xxh3 digest


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"
