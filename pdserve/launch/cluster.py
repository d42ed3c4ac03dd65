"""`pdserve up` as a library: a Ray-hosted cluster (router + pools) with clean start and stop."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from pdcommon.client import ControlClient
from pdcommon.config import ClusterConfig
from pdcommon.security import ClusterIdentity, provision_token, remove_secret, token_path
from pdserve.launch.ports import free_ports

log = logging.getLogger(__name__)

# Every pdserve cluster's actors live in one Ray namespace (each cluster's names carry its own
# prefix): a detached actor made from the anonymous namespace a bare ray.init gives cannot be
# found again by name from another job, and Ray warns about it on every worker started.
RAY_NAMESPACE = "pdserve"


def ray_address(cfg: ClusterConfig) -> str | None:
    """The running Ray cluster to join (the YAML's `ray.address`, else Ray's own convention,
    RAY_ADDRESS), or None: no cluster named, or "local" (an embedded one)."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    return None if address in (None, "", "local") else address


def pin_ports(cfg: ClusterConfig) -> None:
    """Replace the router's port-0 ("any free port") settings with concrete free ports, so that
    workers can be told where the router's control plane is before it listens."""
    r = cfg.router
    attrs = ("port", "http_port", "control_port")
    unset = [attr for attr in attrs if getattr(r, attr) == 0]
    # Every port the router will bind by number, its token port's included, is taken already.
    given = frozenset(port for port in (r.port, r.http_port, r.control_port, r.token_port) if port)
    for attr, port in zip(unset, free_ports(r.host, len(unset), exclude=given), strict=True):
        setattr(r, attr, port)


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@contextlib.contextmanager
def _ray_on_loopback(loopback: bool) -> Iterator[None]:
    """While an embedded Ray starts: told `ray.node_ip_address: 127.0.0.1`, it stays there.
    ray.init swaps a loopback node address for the host's reachable one (Ray 2.60,
    `resolve_ip_for_localhost`), and its GCS, raylet and workers listened on all interfaces
    (`*` and 192.0.2.2 here, behind Ray's token alone). Ray keeps a node on loopback where it runs
    no clusters (its Windows and macOS default): RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when
    Ray is imported and by the daemons ray.init starts. Both go back as they were afterwards, so
    that nothing this process starts later (a `pdserve up` joining a cluster of several hosts)
    inherits them; the node keeps the address it started with."""
    if not loopback or "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in os.environ:
        yield
        return
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray._private.ray_constants as constants

        before, constants.ENABLE_RAY_CLUSTER = not constants.IS_WINDOWS_OR_OSX, False
        try:
            yield
        finally:
            constants.ENABLE_RAY_CLUSTER = before
    finally:
        del os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]


def _ray_token_path() -> Path:
    """The file Ray reads its token from when RAY_AUTH_TOKEN is unset."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def _join_with_token_if_ray_would() -> None:
    """`ray start` turns token auth on when a token is at hand (RAY_AUTH_MODE unset): in
    RAY_AUTH_TOKEN, in the file at RAY_AUTH_TOKEN_PATH, or in ~/.ray/auth_token, Ray's own order.
    A driver joining by address must do the same, before Ray is imported (it reads the mode once),
    or the cluster refuses it. Looking only at ~/.ray/auth_token, a driver whose token came by
    the environment (KubeRay's way, or a path of the user's) joined without it."""
    if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or _ray_token_path().exists()):
        os.environ["RAY_AUTH_MODE"] = "token"


def _keep_ray_token_private() -> None:
    """Ray writes its token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) with the process's
    umask: 0644 here, so any user of the host could read it and run code in this Ray as its owner
    (the embedded one listens on loopback, where every local user can reach it). Only its owner
    reads it (the driver and Ray's daemons run as that user): 0600, as pdserve's own secrets."""
    path = _ray_token_path()
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            path.chmod(0o600)
            log.info("Ray's token file %s was readable by others; now 0600", path)
    except OSError:  # none (token from RAY_AUTH_TOKEN, or auth off), or not ours to change
        pass


@contextlib.contextmanager
def _quiet_default_token_auth() -> Iterator[None]:
    """An embedded Ray instance turns token authentication on by default and logs a warning saying
    so on every start. With RAY_AUTH_MODE unset that is the only thing its logger says, so it is
    kept at ERROR meanwhile; a mode the user set (disabled included) is left to speak."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = logger.level
    if "RAY_AUTH_MODE" not in os.environ:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class RayCluster:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.router = None
        self.address = ""
        self.http_address = ""
        self.control_address = ""
        self._own_ray = False
        self.name = f"pdserve-{uuid.uuid4().hex[:8]}"  # prefix of every actor of this cluster
        self._secret: Path | None = None  # the token file this launcher wrote (removed on stop)

    def _pin_ports(self) -> None:
        """Choose concrete ports now: a router that Ray restarts must come back where the workers
        and clients already look for it."""
        pin_ports(self.cfg)

    def start(self, timeout_s: float = 300.0) -> str:
        address = ray_address(self.cfg)
        if address is not None:
            _join_with_token_if_ray_would()
        import ray

        from pdserve.launch.actors import RouterActor
        from pdserve.launch.placement import on_this_node

        if not ray.is_initialized():
            r = self.cfg.ray
            if address is None:
                # Ray starts workers at nice 15 by default; ours return to process.nice themselves,
                # which needs privilege, so the embedded instance starts them at 0 to begin with.
                with _quiet_default_token_auth(), _ray_on_loopback(_is_loopback(r.node_ip_address)):
                    ray.init(address="local", _node_ip_address=r.node_ip_address, include_dashboard=False,
                             num_cpus=r.num_cpus or os.cpu_count(), log_to_driver=False, configure_logging=False,
                             namespace=RAY_NAMESPACE, _system_config={"worker_niceness": 0})
            else:
                ip = {"_node_ip_address": r.node_ip_address} if r.node_ip_address else {}
                ray.init(address=address, log_to_driver=False, namespace=RAY_NAMESPACE, **ip)
            self._own_ray = True
            _keep_ray_token_private()
        self._pin_ports()
        r = self.cfg.router
        self._secret = provision_token(self.cfg.security, token_path(f"{r.advertise_host or r.host}:{r.port}"))
        ClusterIdentity.from_config(self.cfg.security)  # fail here, not inside an actor, when certs are missing
        cfg = self.cfg.model_dump()
        # Joining a cluster, the router stays on this node: its address is the one printed here.
        where = on_this_node() if address is not None else {}
        self.router = RouterActor.options(name=f"{self.name}-router", **where).remote(cfg, self.name)
        counts = {role: self.cfg.pool(role).replicas for role in self.cfg.roles}
        # Asked first: the workers start while the router does (its ports are fixed above).
        pools = self.router.start_pools.remote(counts, timeout_s)
        ray.get(pools, timeout=timeout_s + 30)
        self.address = ray.get(self.router.address.remote(120.0), timeout=180)
        self.http_address = ray.get(self.router.http_address.remote(), timeout=60)
        self.control_address = ray.get(self.router.control_address.remote(), timeout=60)
        return self.address

    def worker_pids(self) -> dict[str, int]:
        import ray

        return ray.get(self.router.worker_pids.remote(), timeout=60)

    def router_pid(self) -> int:
        import ray

        return ray.get(self.router.pid.remote(), timeout=60)

    def stop(self) -> None:
        import ray

        if self.router is not None:
            try:
                ray.get(self.router.shutdown.remote(), timeout=60)
            except Exception as e:
                log.warning("router shutdown: %r", e)
            ray.kill(self.router, no_restart=True)
            self.router = None
            self._kill_leftovers()
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
            self._own_ray = False
        remove_secret(self._secret)
        self._secret = None

    def _kill_leftovers(self) -> None:
        """Worker actors are detached: if the router could not stop them, stop them here."""
        import ray

        for name in ray.util.list_named_actors():
            if name.startswith(self.name + "-"):
                try:
                    ray.kill(ray.get_actor(name), no_restart=True)
                except ValueError:
                    pass

    def control_client(self) -> ControlClient:
        """The internal control plane (Scale), with this cluster's own credentials."""
        return ControlClient(self.control_address, ClusterIdentity.from_config(self.cfg.security))

    def __enter__(self) -> RayCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
