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


def free_port(host: str, tries: int = 50) -> int:
    """A port that is free on `host` now, outside the ephemeral range when the host says where
    that is (else whatever the kernel gives for port 0)."""
    low = ephemeral_low()
    if low is not None and low > LOWEST + 1000:
        for port in random.sample(range(LOWEST, low), min(tries, low - LOWEST)):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
