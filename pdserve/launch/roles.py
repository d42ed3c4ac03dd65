"""Which server each pool runs: the one place above the workers that maps a role to its code."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

from pdcommon.config import ClusterConfig

ROLES = ("prefill", "decode", "colocated")


def serve_worker(cfg: ClusterConfig, role: str, worker_id: str, router_address: str, stop: asyncio.Event | None = None,
                 started: asyncio.Future | None = None) -> Coroutine:
    if role == "prefill":
        from prefill_worker import serve

        return serve(cfg, worker_id, router_address, stop, started)
    if role in ("decode", "colocated"):  # a colocated worker is a decode worker that also prefills
        from decode_worker import serve

        return serve(cfg, worker_id, router_address, stop, started, role=role)
    raise ValueError(f"unknown worker role {role!r}")
