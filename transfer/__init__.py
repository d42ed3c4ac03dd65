"""KV block transfer between processes: msgpack headers, raw checksummed frames."""

from transfer.base import KVReceiver, KVSender, ReceivedKV, TransferHandle, TransferState
from transfer.registry import make_receiver, make_sender, register_transport
from transfer.wire import KVHeader, TransferError, build_header, checksum, frame_runs, verify

__all__ = ["KVHeader", "KVReceiver", "KVSender", "ReceivedKV", "TransferError", "TransferHandle", "TransferState",
           "build_header", "checksum", "frame_runs", "make_receiver", "make_sender", "register_transport", "verify"]
