"""The router: public gRPC API, admission, routing, membership. Talks to workers only over the wire."""

from router.core import RouterCore
from router.request import RequestFailed
from router.server import RouterServer, serve

__all__ = ["RequestFailed", "RouterCore", "RouterServer", "serve"]
