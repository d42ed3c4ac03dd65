"""The environment an engine process must start with: settings read once, at process start.

- OpenMP and MKL team sizes: the engine's thread count, so two workers on one host do not each
  start a team per core.
- glibc malloc: a step allocates large temporaries (gathered KV, activations: tens of MB). By
  default glibc serves each one over 32 MB by a fresh mmap and returns freed heap tops to the
  kernel, so the next step page-faults the same memory in again. Measured here: a 35 MB KV
  gather took 16 ms fresh against 2 ms with these settings (1.7 ms into a reused buffer), and a
  64-sequence decode step at 512 tokens 340-380 ms against 130-165 ms. vLLM gets the same effect
  from tcmalloc; these are glibc's own tunables, so nothing extra is installed. The cost: freed
  memory stays with the process (its RSS keeps its peak).
- GNU OpenMP's spin before a helper thread sleeps (GOMP_SPINCOUNT), for prefill workers: see
  PREFILL_SPIN_COUNT.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcommon.config import ClusterConfig

MALLOC_TUNABLES = {
    "glibc.malloc.mmap_threshold": str(4 << 30),  # large blocks come from the heap, not fresh mmaps
    "glibc.malloc.trim_threshold": str(16 << 30),  # and stay there when freed
}

# After a parallel region, each of GNU OpenMP's helper threads spins waiting for the next one
# before it sleeps: by default 300,000 turns, ~10 ms of a core on a 2-core AMD EPYC. A prefill
# worker's last step before it idles hands the KV to its sender thread, which hashes every frame
# (at transfer threads' lower priority, process.kv_nice) while the helpers spin at the engine's:
# the spin took the core the sender and the decode worker's receiver needed. With 20,000 turns
# (~0.6 ms), in a 1P+1D cluster of 2 threads per worker, a 2048-token prompt's KV moved in
# 3.8-4.5 ms (medians of 10 requests, two runs) instead of 6.0-6.2 ms, and the second token came
# 1.63x ITL after the first instead of 1.76-1.93x. Prefill steps are long and their regions back
# to back, so their time did not move (512 / 2048 tokens in-process, medians of four runs each:
# 146-169 / 689-772 ms against 146-161 / 700-742 ms). Decode workers keep the default: their
# steps come a millisecond apart under load, and a helper woken for each would cost every step.
PREFILL_SPIN_COUNT = "20000"


def _merge_tunables(current: str) -> str:
    """Add our tunables to a GLIBC_TUNABLES value, keeping any the user set (theirs win)."""
    items = [kv for kv in current.split(":") if kv]
    have = {kv.split("=", 1)[0] for kv in items}
    items += [f"{k}={v}" for k, v in MALLOC_TUNABLES.items() if k not in have]
    return ":".join(items)


def engine_process_env(threads: int | None, tune_malloc: bool = True,
                       base: Mapping[str, str] | None = None, role: str = "") -> dict[str, str]:
    """The variables to start an engine process with (only the ones this module sets); `role`:
    the worker's pool (prefill, decode, colocated), or "" for an engine outside any pool."""
    base = os.environ if base is None else base
    n = str(threads or 1)
    env = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}
    if role == "prefill" and (threads or 1) > 1 and "GOMP_SPINCOUNT" not in base:
        env["GOMP_SPINCOUNT"] = PREFILL_SPIN_COUNT  # one thread has no helpers to spin
    if tune_malloc:
        env["GLIBC_TUNABLES"] = _merge_tunables(base.get("GLIBC_TUNABLES", ""))
    return env


def worker_process_env(cfg: ClusterConfig, role: str) -> dict[str, str]:
    """engine_process_env for a worker of `role`'s pool in this cluster: its thread count, the
    cluster's malloc choice and the role's own settings (what every launcher starts it with)."""
    return engine_process_env(cfg.engine_config(role).num_threads, cfg.process.tune_malloc, role=role)


def missing_from(env: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    """Whether this process lacks the malloc tunables of `wanted` (the others can still be set
    in-process: torch reads its thread count when told)."""
    have = set(env.get("GLIBC_TUNABLES", "").split(":"))
    return any(kv not in have for kv in wanted.get("GLIBC_TUNABLES", "").split(":") if kv)
