"""Transport registry: the config names a transport, this returns its sender/receiver."""

from __future__ import annotations

from collections.abc import Callable

from transfer.base import KVReceiver, KVSender, KVSink
from transfer.fake import FakeReceiver, FakeSender
from transfer.grpc_receiver import GrpcReceiver
from transfer.grpc_sender import GrpcSender
from transfer.wire import KeyLookup
from transfer.zmq_receiver import ZmqReceiver
from transfer.zmq_sender import ZmqSender

TRANSPORTS: dict[str, tuple[Callable[..., KVSender], Callable[..., KVReceiver]]] = {
    "zmq": (ZmqSender, ZmqReceiver),
    "grpc": (GrpcSender, GrpcReceiver),
    "fake": (FakeSender, FakeReceiver),
}


def _lookup(name: str) -> tuple[Callable[..., KVSender], Callable[..., KVReceiver]]:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


def make_sender(name: str, curve: bool = False, channel_credentials=None, channel_options=None) -> KVSender:
    """`curve`: encrypt with ZeroMQ CURVE (zmq); `channel_credentials`: TLS for the gRPC transport."""
    kwargs: dict = {}
    if name == "zmq":
        kwargs = {"curve": curve}
    elif name == "grpc":
        kwargs = {"channel_credentials": channel_credentials, "channel_options": channel_options}
    return _lookup(name)[0](**kwargs)


def make_receiver(name: str, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                  sink: KVSink | None = None, partial_timeout_s: float | None = None,
                  max_frame_bytes: int | None = None, keys: KeyLookup | None = None, curve: bool = False,
                  max_per_peer: int | None = None, server_credentials=None, shared_memory: bool = True) -> KVReceiver:
    """`sink` is used by transports that stream frames (zmq, grpc); the others deliver whole transfers.
    `partial_timeout_s`: how long a streaming receiver keeps a transfer whose frames stopped.
    `keys`: the transfer key of a header's reservation; with it, unsigned KV is refused.
    `shared_memory` (zmq): map same-host senders' offered memory and take frames by reference."""
    kwargs: dict = {"keys": keys}
    if name == "zmq":
        kwargs.update({k: v for k, v in (("sink", sink), ("partial_timeout_s", partial_timeout_s),
                                         ("max_per_peer", max_per_peer)) if v is not None}, curve=curve,
                      shared_memory=shared_memory)
        if max_frame_bytes is not None:
            kwargs["max_message_bytes"] = max_frame_bytes + (1 << 20)
    elif name == "grpc":
        kwargs.update(server_credentials=server_credentials, sink=sink)
    return _lookup(name)[1](host=host, port=port, advertise_host=advertise_host, **kwargs)


def register_transport(name: str, sender: Callable[..., KVSender], receiver: Callable[..., KVReceiver]) -> None:
    TRANSPORTS[name] = (sender, receiver)
