"""What the router needs from whoever creates worker processes (Ray actors, Kubernetes...).

The router owns membership and draining; a launcher only starts and stops processes."""

from __future__ import annotations

from typing import Protocol


class Launcher(Protocol):
    async def add_worker(self, role: str) -> str:
        """Start one worker of `role`; returns its worker id. It registers with the router itself."""
        ...

    async def remove_worker(self, worker_id: str) -> None:
        """Stop a worker the router has drained."""
        ...
