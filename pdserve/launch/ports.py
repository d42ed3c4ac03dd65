"""Free ports chosen now and bound later (a router's ports, pinned before Ray starts it).

Binding port 0 and closing the socket hands back a port from the kernel's ephemeral range, the
same range every other port-0 bind and every outgoing connection on the host draws from. Between
the pick and the router's bind (seconds, while Ray starts an actor and opens dozens of
connections of its own) someone else got the port once in a CI run, and the router died with
EADDRINUSE. A port below the ephemeral range is only ever taken by someone asking for it by
number."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # below: well-known and registered services' neighbourhood


def ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), None where it cannot be read."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_ports(host: str, n: int, tries: int = 50, exclude: frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct ports free on `host` now and not in `exclude` (ports already promised to
    someone), outside the ephemeral range when the host says where that is (else whatever the
    kernel gives for port 0). Each probe stays bound until all `n` are chosen: picked one at a
    time and released, two picks could name the same port, and the router's HTTP bind then lost
    to its own gRPC server (seen once in CI)."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            held.append(_probe(host, tries, exclude))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port(host: str, tries: int = 50) -> int:
    """One port free on `host` now (see free_ports)."""
    return free_ports(host, 1, tries)[0]


def _probe(host: str, tries: int, exclude: frozenset[int]) -> socket.socket:
    """A socket bound to a free port below the ephemeral range where there is one, else to the
    kernel's choice; the caller closes it."""
    low = ephemeral_low()
    candidates = random.sample(range(LOWEST, low), min(tries, low - LOWEST)) if low and low > LOWEST + 1000 else []
    for port in [*(c for c in candidates if c not in exclude), *[0] * tries]:
        s = socket.socket()
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            continue
        if s.getsockname()[1] in exclude:  # the kernel's choice can be a promised port too
            s.close()
            continue
        return s
    raise OSError(f"no free port on {host}")
