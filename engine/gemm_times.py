"""GEMM timings kept between starts (cpu_gemm "auto", engine/gemm_plan.py).

One start's measurement is at the mercy of whatever else runs then, and a worker starts beside
its router, which is busy starting too. On an Intel Xeon host the native kernel ran 2048-row
prompts 1.4x slower than MKL, yet three starts of one colocated cluster routed the QKV
projection's large row counts to it twice (and prompts were served 1.5x slower than the same
engine prefilled them in-process). Noise only ever adds time, so the fastest time seen for a
(shape, rows, kernel) over several starts is the one to trust: each start merges its
measurement into a file by minimum, and from SETTLED starts on, the file decides and nothing is
measured (which also takes the measurement, 1-2 s for the 50M model, off the start-up).

The file lives beside the native kernels' builds (engine/kernels.py cache_dir, so
PDSERVE_KERNEL_CACHE moves both) and is named by what the times depend on: the CPU, torch and
its thread count, the native GEMM's source, and the layers and row counts measured. Delete it to
measure afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from engine.kernels import CSRC, FLAGS, cache_dir, cpu_description

log = logging.getLogger(__name__)

SETTLED = 3  # starts whose measurements merged, after which the file decides alone
Times = dict[str, dict[int, dict[str, float]]]  # shape -> rows -> kernel -> seconds per pass


def times_path(shapes: list[str], limits: list[int], method: tuple) -> Path:
    """The file for these measured layers (shape names in probe order), their row limits and
    how they are measured (row counts, ...), on this host, torch build and thread count."""
    # The one kernel timed here (MKL and oneDNN: torch's version), and how it was compiled.
    sources = [(CSRC / "panel_gemm.c").read_text(), *FLAGS]
    key = hashlib.sha256("\0".join([cpu_description(), torch.__version__, str(torch.get_num_threads()), *sources,
                                    repr(shapes), repr(limits), repr(method)]).encode()).hexdigest()[:16]
    return cache_dir() / f"gemm-times-{key}.json"


def load(path: Path) -> tuple[int, Times]:
    """(starts merged, times) from the file; (0, {}) when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        times = {shape: {int(rows): {k: float(s) for k, s in by_kernel.items()} for rows, by_kernel in by_rows.items()}
                 for shape, by_rows in data["times"].items()}
        return int(data["starts"]), times
    except FileNotFoundError:
        return 0, {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring unreadable GEMM timings %s: %s", path, e)
        return 0, {}


def merge(old: Times, new: Times) -> Times:
    """Per (shape, rows, kernel), the fastest of the two (noise only adds time)."""
    out = {shape: {rows: dict(by_kernel) for rows, by_kernel in by_rows.items()} for shape, by_rows in old.items()}
    for shape, by_rows in new.items():
        for rows, by_kernel in by_rows.items():
            have = out.setdefault(shape, {}).setdefault(rows, {})
            for kernel, s in by_kernel.items():
                have[kernel] = min(have.get(kernel, s), s)
    return out


def save(path: Path, starts: int, times: Times) -> None:
    """Write atomically (workers starting together on one host never read half a file); a
    read-only cache only costs the next start a measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"starts": starts, "times": times}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep GEMM timings in %s: %s", path, e)
