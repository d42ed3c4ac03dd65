"""Routing policies: which prefill worker computes a prompt, which decode worker holds it.

A prefill worker is chosen by the prompt tokens it still has to compute, this prompt's included:
a queue of one 8k-token prompt is longer than one of three short ones, so counting requests
would send long prompts behind each other. `prefix_aware` remembers which workers last served
each prompt block (by the same hash chain the engines use) and counts the blocks a worker
already holds as free: a warm cache wins exactly when it saves more than the queue costs, so a
popular prefix cannot pile its conversations onto one worker. Decode placement prefers the
holder while its load stays close to the least loaded (a hit there saves only transfer)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from router.membership import WorkerRecord

LOAD_SLACK = 2  # extra in-flight requests a decode holder may carry and still be preferred


class RoutingPolicy(Protocol):
    def pick_prefill(self, workers: list[WorkerRecord], prefix: list[int], prompt_tokens: int) -> WorkerRecord | None:
        ...

    def expected_cached(self, worker: WorkerRecord, prefix: list[int], prompt_tokens: int) -> int:
        """Prompt tokens `worker` is expected to find in its prefix cache (what it will not compute)."""
        ...

    def rank_decode(self, workers: list[WorkerRecord], prefix: list[int], need_blocks: int) -> list[WorkerRecord]: ...

    def record(self, prefix: list[int], prefill_id: str, decode_id: str) -> None: ...


class LeastLoaded:
    def pick_prefill(self, workers: list[WorkerRecord], prefix: list[int], prompt_tokens: int) -> WorkerRecord | None:
        return min(workers, key=lambda w: (w.queued_tokens, w.load, w.worker_id), default=None)

    def expected_cached(self, worker: WorkerRecord, prefix: list[int], prompt_tokens: int) -> int:
        return 0

    def rank_decode(self, workers: list[WorkerRecord], prefix: list[int], need_blocks: int) -> list[WorkerRecord]:
        fits = [w for w in workers if w.free_blocks_estimate >= need_blocks]
        return sorted(fits, key=lambda w: (w.load, -w.free_blocks_estimate, w.worker_id))

    def record(self, prefix: list[int], prefill_id: str, decode_id: str) -> None:
        pass


class PrefixAware(LeastLoaded):
    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self.owner: OrderedDict[int, tuple[str, str]] = OrderedDict()  # block hash -> (prefill, decode)

    def _held(self, prefix: list[int], slot: int) -> tuple[str | None, int]:
        """The worker that last served the deepest known block of `prefix`, and how many blocks deep."""
        for depth in range(len(prefix), 0, -1):
            hit = self.owner.get(prefix[depth - 1])
            if hit is not None:
                self.owner.move_to_end(prefix[depth - 1])
                return hit[slot], depth
        return None, 0

    def expected_cached(self, worker: WorkerRecord, prefix: list[int], prompt_tokens: int) -> int:
        return _saved(worker, self._held(prefix, 0), prompt_tokens)

    def pick_prefill(self, workers: list[WorkerRecord], prefix: list[int], prompt_tokens: int) -> WorkerRecord | None:
        held = self._held(prefix, 0)
        # Tokens w computes before this prompt's first token, less the prompt itself (the same everywhere).
        return min(workers, key=lambda w: (w.queued_tokens - _saved(w, held, prompt_tokens), w.load, w.worker_id),
                   default=None)

    def rank_decode(self, workers: list[WorkerRecord], prefix: list[int], need_blocks: int) -> list[WorkerRecord]:
        ranked = super().rank_decode(workers, prefix, need_blocks)
        holder = self._held(prefix, 1)[0]
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


def _saved(worker: WorkerRecord, held: tuple[str | None, int], prompt_tokens: int) -> int:
    """Prompt tokens `worker` finds cached, if it is the holder of `held` (holder, blocks deep)."""
    holder, depth = held
    # The engine always computes the last prompt token (it yields the first output token).
    return min(depth * worker.block_size, max(prompt_tokens - 1, 0)) if holder == worker.worker_id else 0


POLICIES: dict[str, type] = {"least_loaded": LeastLoaded, "prefix_aware": PrefixAware}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
