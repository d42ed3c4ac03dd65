"""What the router needs from whoever creates worker processes (Ray actors, Kubernetes...).

The router owns membership and draining; a launcher only starts and stops processes."""

from __future__ import annotations

from typing import Protocol


class Launcher(Protocol):
    # True where the platform replaces a dead worker itself (a Deployment recreates its pod):
    # the router then does not replace it too.
    self_healing: bool

    async def add_worker(self, role: str) -> str:
        """Start one worker of `role`; returns its worker id (or a placeholder where the platform
        names it). It registers with the router itself."""
        ...

    async def remove_worker(self, worker_id: str, role: str) -> None:
        """Stop a worker of `role` the router has drained."""
        ...
