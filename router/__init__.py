"""The router: public gRPC API, admission, routing, membership. Talks to workers only over the wire."""

from router.core import RequestFailed, RouterCore
from router.server import RouterServer, serve

__all__ = ["RequestFailed", "RouterCore", "RouterServer", "serve"]
