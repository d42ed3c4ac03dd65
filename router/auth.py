"""API keys for the public API: `Authorization: Bearer <key>` on HTTP (401 in OpenAI's shape) and
the same metadata on gRPC (UNAUTHENTICATED). With no key configured the public API is open.

Keys come from `router.api_keys`, a file (`router.api_keys_file`, one per line) or the
PDSERVE_API_KEYS environment variable (comma-separated): a file or the environment keeps them out
of process arguments and out of a YAML that may be committed."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

from pdcommon.grpc_server import refusal

ENV = "PDSERVE_API_KEYS"
PUBLIC_SERVICE = "/pdserve.v1.Router/"
OPEN_PROBES = ("/health", "/metrics")  # open unless router.protect_probes


def load_api_keys(keys: list[str], keys_file: str | None) -> frozenset[str]:
    found = [k.strip() for k in keys]
    if keys_file:
        found += [line.strip() for line in Path(keys_file).read_text().splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]
    found += [k.strip() for k in os.environ.get(ENV, "").split(",")]
    return frozenset(k for k in found if k)


class ApiKeys:
    def __init__(self, keys: frozenset[str], protect_probes: bool = False) -> None:
        self.keys, self.protect_probes = keys, protect_probes

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> bool:
        """Constant-time comparison against every key (no early exit that times the match)."""
        if not self.keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token.strip().encode(), key.encode())
        return ok and scheme.lower() == "bearer"

    def http_needs_key(self, path: str) -> bool:
        return self.enabled and (self.protect_probes or path not in OPEN_PROBES)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks the public Router service only: the Control service on the same port answers workers."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method
        if not method.startswith(PUBLIC_SERVICE) or not self.keys.enabled:
            return await continuation(details)
        if method.endswith("/Health") and not self.keys.protect_probes:
            return await continuation(details)
        md = {k: v for k, v in (details.invocation_metadata or ())}
        if self.keys.check(md.get("authorization")):
            return await continuation(details)
        return refusal(grpc.StatusCode.UNAUTHENTICATED, _DENIED, method.endswith("/Generate"))


_DENIED = "missing or invalid API key: send 'authorization: Bearer <key>' metadata"
