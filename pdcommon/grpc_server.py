"""gRPC servers as every component builds them: one message-size limit everywhere, and a request
that does not parse answered INVALID_ARGUMENT (grpc's default turns it into UNKNOWN/INTERNAL)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """For servers and channels alike, so router and workers agree on what fits."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


# HTTP/2 streams one connection may carry at once. gRPC's default (100) makes the router's
# channel to a worker queue the 101st request of a burst on the client side.
MAX_CONCURRENT_STREAMS = 8192


def make_server(max_message_bytes: int, interceptors: list | None = None) -> grpc.aio.Server:
    return grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        *message_options(max_message_bytes)])


class Malformed:
    """Stands in for a request that did not parse, so the handler can refuse it by name."""

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # DecodeError and friends: the client sent garbage
            return Malformed(f"{type(e).__name__}: {e}")
    return deserialize


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message ({request.error})")


class ServiceUnavailable(RuntimeError):
    """Raised in a handler: this server can no longer serve the call (its engine stopped). The call
    fails UNAVAILABLE, which the router takes as "drop this worker, retry elsewhere"."""


def _unary(fn):
    async def handle(request, context):
        if isinstance(request, Malformed):
            await _refuse(request, context)
        try:
            return await fn(request, context)
        except ServiceUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    return handle


def _stream(fn):
    async def handle(request, context):
        if isinstance(request, Malformed):
            await _refuse(request, context)
        try:
            async for msg in fn(request, context):
                yield msg
        except ServiceUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    return handle


def refusal(code: grpc.StatusCode, message: str, streaming: bool) -> grpc.RpcMethodHandler:
    """A handler that refuses a call without running anything or parsing the request (for
    interceptors: API keys on the public API, the cluster token on the control plane)."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # an async generator, as a streaming handler must be

    if streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


def add_service(server: grpc.aio.Server, servicer: Any, service: ServiceDescriptor) -> None:
    """Register `servicer` for every unary-request method of `service` (by descriptor, the same
    names and types the generated code uses)."""
    handlers = {}
    for m in service.methods:
        if m.client_streaming:
            raise ValueError(f"{service.full_name}.{m.name}: client-streaming methods are registered elsewhere")
        parse = _safe(message_factory.GetMessageClass(m.input_type).FromString)
        out = message_factory.GetMessageClass(m.output_type).SerializeToString
        fn = getattr(servicer, m.name)
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(_stream(fn), parse, out)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(_unary(fn), parse, out)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
