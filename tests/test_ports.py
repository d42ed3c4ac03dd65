"""Ports pinned before a router binds them come from outside the kernel's ephemeral range, which
every port-0 bind and outgoing connection on the host draws from (a CI run lost the race once:
the router died with EADDRINUSE), and are distinct (another CI run: two picks named the same port,
and the router's HTTP bind lost to its own gRPC server)."""

from __future__ import annotations

import socket

import pytest

from pdcommon.config import ClusterConfig
from pdserve.launch.cluster import pin_ports
from pdserve.launch.ports import ephemeral_low, free_port, free_ports


@pytest.mark.skipif(ephemeral_low() is None, reason="the kernel's ephemeral port range is not readable here")
def test_pinned_ports_are_free_and_below_the_ephemeral_range():
    low = ephemeral_low()
    cfg = ClusterConfig.model_validate({"model": "m", "router": {"port": 0, "http_port": 0, "control_port": 0}})
    pin_ports(cfg)
    ports = [cfg.router.port, cfg.router.http_port, cfg.router.control_port, free_port("127.0.0.1")]
    assert all(0 < p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing held it


def test_a_taken_port_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr("random.sample", lambda population, k: [taken] * k)
        port = free_port("127.0.0.1")  # every candidate is taken: the kernel's choice, not `taken`
        assert port != taken


def test_the_router_ports_pinned_together_are_distinct(monkeypatch):
    """Every pick draws the same candidates: each port must still differ from the ones before it."""
    low = ephemeral_low() or 32768
    monkeypatch.setattr("random.sample", lambda population, k: list(range(low - 400, low - 400 + k)))
    cfg = ClusterConfig.model_validate({"model": "m", "router": {"port": 0, "http_port": 0, "control_port": 0}})
    pin_ports(cfg)
    ports = [cfg.router.port, cfg.router.http_port, cfg.router.control_port]
    assert len(set(ports)) == 3, ports
    assert len(set(free_ports("127.0.0.1", 5))) == 5


def test_ports_pinned_beside_a_given_one_avoid_it(monkeypatch):
    """A control port given by number but not yet bound (as `pdserve up --control-port N`) is not
    handed out again for the gRPC or HTTP port."""
    low = ephemeral_low() or 32768
    given = low - 400
    monkeypatch.setattr("random.sample", lambda population, k: list(range(given, given + k)))
    cfg = ClusterConfig.model_validate({"model": "m", "router": {"port": 0, "http_port": 0, "control_port": given}})
    pin_ports(cfg)
    assert given not in (cfg.router.port, cfg.router.http_port), cfg.router


def test_ports_pinned_beside_a_given_token_port_avoid_it(monkeypatch):
    """The router binds its token port by number too (`router.token_port`): not handed out again."""
    low = ephemeral_low() or 32768
    given = low - 400
    monkeypatch.setattr("random.sample", lambda population, k: list(range(given, given + k)))
    cfg = ClusterConfig.model_validate({"model": "m", "router": {"port": 0, "http_port": 0, "token_port": given}})
    pin_ports(cfg)
    assert given not in (cfg.router.port, cfg.router.http_port, cfg.router.control_port), cfg.router
