"""KV block transfer between processes: msgpack headers, raw checksummed frames."""

from transfer.base import KVReceiver, KVSender, KVSink, ReceivedKV, TransferHandle, TransferState
from transfer.registry import make_receiver, make_sender, register_transport
from transfer.sender_loop import SenderLoop
from transfer.wire import (
    KVHeader,
    TransferError,
    build_header,
    checksum,
    fill_checksums,
    verify,
    verify_frame,
    verify_layout,
)

__all__ = ["KVHeader", "KVReceiver", "KVSender", "KVSink", "ReceivedKV", "SenderLoop", "TransferError",
           "TransferHandle", "TransferState", "build_header", "checksum", "fill_checksums", "make_receiver",
           "make_sender", "register_transport", "verify", "verify_frame", "verify_layout"]
