"""Cluster identity: how router and workers know each other on the internal control plane.

Three modes (`security.mode`):
- `token`: a shared cluster secret, sent as gRPC metadata on every internal call and compared in
  constant time by the callee. It proves the caller holds the secret; it does not encrypt, so an
  attacker who can read the traffic can learn it (that is what `mtls` is for).
- `mtls`: mutual TLS. Every internal server requires a client certificate signed by the
  cluster's CA and every channel checks the server's; nothing travels in clear.
- `none`: no checks at all, chosen explicitly and logged as a warning.

Secrets come from files (or, for the token, the environment), never from process arguments or
the YAML itself: `security.token_file` / PDSERVE_CLUSTER_TOKEN, `security.certs_dir` /
PDSERVE_CERTS_DIR (a `pdserve certs` folder or a mounted Kubernetes Secret)."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdcommon.grpc_server import refusal

log = logging.getLogger(__name__)

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
CERTS_ENV = "PDSERVE_CERTS_DIR"
METADATA_KEY = "x-pdserve-cluster-token"
# Certificates name the cluster, not a host: pods and actors come and go on any address, and
# holding a certificate signed by the cluster's CA is what makes a component a member.
CLUSTER_NAME = "pdserve-cluster"
CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "node.pem", "node.key"


class SecurityConfigError(RuntimeError):
    """A component cannot start in its security mode: its secret or certificates are missing."""


@dataclass(frozen=True, slots=True)
class Certs:
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, folder: str | Path) -> Certs:
        d = Path(folder)
        try:
            return cls(*((d / name).read_bytes() for name in (CA_FILE, CERT_FILE, KEY_FILE)))
        except OSError as e:
            raise SecurityConfigError(f"security.mode is mtls but the certificates in {d} cannot be read ({e}); "
                                      f"create them with `pdserve certs --out {d}`") from e


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_secret(path: Path, data: str | bytes) -> Path:
    """A file only its owner can read, created that way (never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return path


class ClusterIdentity:
    """This component's credentials for the internal control plane, as servers and channels use them."""

    def __init__(self, mode: str, token: str | None = None, certs: Certs | None = None) -> None:
        self.mode, self._token, self.certs = mode, token, certs

    @classmethod
    def from_config(cls, security) -> ClusterIdentity:
        """Raises SecurityConfigError naming what is missing: a component never makes up a secret."""
        mode = security.mode
        if mode == "none":
            return cls("none")
        if mode == "mtls":
            folder = security.certs_dir or os.environ.get(CERTS_ENV)
            if not folder:
                raise SecurityConfigError("security.mode is mtls but no certificates are configured: set "
                                          f"security.certs_dir or {CERTS_ENV} (create them with `pdserve certs`)")
            return cls("mtls", certs=Certs.load(folder))
        token = None
        if security.token_file:
            try:
                token = Path(security.token_file).read_text().strip()
            except OSError as e:
                raise SecurityConfigError(f"cannot read the cluster token file {security.token_file}: {e}") from e
        token = token or os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise SecurityConfigError(f"security.mode is token but no cluster secret is configured: set "
                                      f"security.token_file or {TOKEN_ENV} (`pdserve up` makes one for you), or "
                                      f"choose security.mode: none explicitly")
        if len(token) < 16:
            raise SecurityConfigError("the cluster token is shorter than 16 characters; use a random one "
                                      "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        return cls("token", token=token)

    def warn_if_open(self, what: str) -> None:
        if self.mode == "none":
            log.warning("security.mode is none: %s accepts internal calls from anyone who can reach it", what)

    # ---- servers ---------------------------------------------------------------------------------
    def bind(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        """Add a listening port with this mode's transport security (0: could not bind)."""
        if self.mode == "mtls":
            return server.add_secure_port(address, self._server_creds())
        return server.add_insecure_port(address)

    def _server_creds(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.certs.key, self.certs.cert)], root_certificates=self.certs.ca,
                                           require_client_auth=True)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self._token)] if self.mode == "token" else []

    # ---- clients ---------------------------------------------------------------------------------
    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Metadata every internal call carries (the token; nothing under mtls or none)."""
        return ((METADATA_KEY, self._token),) if self.mode == "token" else None

    def _channel_creds(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
        creds = grpc.ssl_channel_credentials(self.certs.ca, self.certs.key, self.certs.cert)
        return creds, [("grpc.ssl_target_name_override", CLUSTER_NAME)]

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        if self.mode != "mtls":
            return grpc.insecure_channel(address, options=options)
        creds, extra = self._channel_creds()
        return grpc.secure_channel(address, creds, options=[*(options or []), *extra])

    def aio_channel(self, address: str, options: list | None = None) -> grpc.aio.Channel:
        if self.mode != "mtls":
            return grpc.aio.insecure_channel(address, options=options)
        creds, extra = self._channel_creds()
        return grpc.aio.secure_channel(address, creds, options=[*(options or []), *extra])

    # ---- for the gRPC KV transport (transfer/ takes plain grpc credentials) ---------------------
    def transfer_credentials(self) -> dict:
        if self.mode != "mtls":
            return {}
        creds, extra = self._channel_creds()
        return {"server_credentials": self._server_creds(), "channel_credentials": creds, "channel_options": extra}


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that does not carry the cluster token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        sent = next((v for k, v in (details.invocation_metadata or ()) if k == METADATA_KEY), "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._token):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # unknown method: let grpc answer UNIMPLEMENTED as usual
            return None
        return refusal(grpc.StatusCode.UNAUTHENTICATED, _DENIED, handler.response_streaming)


_DENIED = "this is the cluster's internal control plane: the call lacks the cluster token"


# ---- launchers: `pdserve up` and the in-process cluster provision the secret themselves ------------
STATE_DIR = Path.home() / ".pdserve" / "clusters"


def token_path(router_address: str) -> Path:
    """Where `pdserve up` keeps the token of the cluster whose public API is `router_address`, so
    operator commands on this machine (`pdserve scale`) find it without it being typed anywhere."""
    return STATE_DIR / router_address.replace(":", "-").replace("/", "_") / "token"


def provision_token(security, path: Path) -> Path | None:
    """For a launcher that starts every component itself: in token mode without a configured
    secret, write one (PDSERVE_CLUSTER_TOKEN's, else a new one) to `path` (0600) and point the
    config at it. Components only ever read the file: the secret is in no argument, no Ray
    runtime environment and no log. Returns the file it wrote, for the launcher to remove."""
    if security.mode != "token" or security.token_file:
        return None
    write_secret(path, os.environ.get(TOKEN_ENV, "").strip() or new_token())
    security.token_file = str(path)
    return path


def remove_secret(path: Path | None) -> None:
    if path is None:
        return
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass
