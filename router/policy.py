"""Routing policies: which prefill worker computes a prompt, which decode worker holds it.

`prefix_aware` remembers which workers last served each prompt block (by the same hash chain
the engines use) and prefers them while their load stays close to the least loaded, so shared
system prompts hit warm prefix caches on both sides."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from router.membership import WorkerRecord

LOAD_SLACK = 2  # extra in-flight requests accepted for a prefix hit


class RoutingPolicy(Protocol):
    def pick_prefill(self, workers: list[WorkerRecord], prefix: list[int]) -> WorkerRecord | None: ...

    def rank_decode(self, workers: list[WorkerRecord], prefix: list[int], need_blocks: int) -> list[WorkerRecord]: ...

    def record(self, prefix: list[int], prefill_id: str, decode_id: str) -> None: ...


class LeastLoaded:
    def pick_prefill(self, workers: list[WorkerRecord], prefix: list[int]) -> WorkerRecord | None:
        return min(workers, key=lambda w: (w.load, w.worker_id), default=None)

    def rank_decode(self, workers: list[WorkerRecord], prefix: list[int], need_blocks: int) -> list[WorkerRecord]:
        fits = [w for w in workers if w.free_blocks_estimate >= need_blocks]
        return sorted(fits, key=lambda w: (w.load, -w.free_blocks_estimate, w.worker_id))

    def record(self, prefix: list[int], prefill_id: str, decode_id: str) -> None:
        pass


class PrefixAware(LeastLoaded):
    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self.owner: OrderedDict[int, tuple[str, str]] = OrderedDict()  # block hash -> (prefill, decode)

    def _holder(self, prefix: list[int], slot: int) -> str | None:
        for h in reversed(prefix):
            hit = self.owner.get(h)
            if hit is not None:
                self.owner.move_to_end(h)
                return hit[slot]
        return None

    def pick_prefill(self, workers: list[WorkerRecord], prefix: list[int]) -> WorkerRecord | None:
        best = super().pick_prefill(workers, prefix)
        holder = self._holder(prefix, 0)
        for w in workers:
            if w.worker_id == holder and best is not None and w.load <= best.load + LOAD_SLACK:
                return w
        return best

    def rank_decode(self, workers: list[WorkerRecord], prefix: list[int], need_blocks: int) -> list[WorkerRecord]:
        ranked = super().rank_decode(workers, prefix, need_blocks)
        holder = self._holder(prefix, 1)
        if ranked and holder is not None:
            for i, w in enumerate(ranked):
                if w.worker_id == holder and w.load <= ranked[0].load + LOAD_SLACK:
                    ranked.insert(0, ranked.pop(i))
                    break
        return ranked

    def record(self, prefix: list[int], prefill_id: str, decode_id: str) -> None:
        for h in prefix:
            self.owner[h] = (prefill_id, decode_id)
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)


POLICIES: dict[str, type] = {"least_loaded": LeastLoaded, "prefix_aware": PrefixAware}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
