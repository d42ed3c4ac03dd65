"""Native kernels: C sources in engine/csrc, compiled on first use with the system's C compiler
and cached by content (the headers beside them included), compiler and CPU. They are an
optimization, never a requirement: where no compiler is found or a build fails, `paged_decode`,
`prefill_attention`, `panel_gemm`, `elementwise`, `rms_norm`, `sample_rows` and `stream_copy` are
None and the engine uses torch ops (attention, RMSNorm, activations, rotary embeddings, sampling),
MKL or oneDNN (linear layers) and memcpy (landing KV).

The shared object links OpenMP by soname (libgomp.so.1). torch has loaded its own copy under
that name by the time this runs, so the kernel joins torch's thread team instead of starting a
second runtime whose spinning threads would fight torch's for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
# -std=c11 alone turns floating-point contraction off: a*b+c stays a multiply and an add, never
# one FMA, which halved the panel GEMM's arithmetic rate (its 32-row case fell behind oneDNN).
# -mprefer-vector-width=512: for Intel's AVX-512 cores (-march=sapphirerapids and the like) GCC
# vectorizes loops 256 bits wide unless told otherwise, so the panel GEMM's 32-float rows took
# four registers each, not two, and tiles of 9-12 rows spilled their accumulators: 85-100
# GFLOP/s at 9-64 rows against 190-220 at 8 (Intel Xeon, 2 cores), and a batch-32 decode step
# of the 50M model ran its layers on oneDNN instead. With it: 280-310 GFLOP/s at 12-64 rows.
# Without AVX-512 it changes nothing; on the AMD EPYC (Zen 4) hosts of earlier sessions these
# tiles already ran at the full rate.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast",
         "-mprefer-vector-width=512",
         "-std=c11"]


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def cpu_description() -> str:
    """The CPU's model name and flags (what a build with -march=native, or a timing, depends on)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    first = {}
    for ln in lines:
        key = ln.split(":", 1)[0].strip()
        if key in ("model name", "flags"):
            first.setdefault(key, ln)
    return "\n".join(first.values())


def _build(cc: str, src: Path) -> Path:
    version = subprocess.run([cc, "-dumpfullversion"], capture_output=True, text=True, timeout=30).stdout.strip()
    headers = [h.read_text() for h in sorted(src.parent.glob("*.h"))]  # sources include them (simd.h)
    key = hashlib.sha256("\0".join([src.read_text(), *headers, cc, version, *FLAGS, platform.machine(),
                                     cpu_description()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{src.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, str(src), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(src: str, what: str) -> ctypes.CDLL | None:
    """The shared object built from csrc/`src`, or None (logged: `what` falls back)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: %s", what)
        return None
    try:
        import torch  # noqa: F401  (its libgomp must be loaded first; see the module docstring)

        return ctypes.CDLL(str(_build(cc, CSRC / src)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native kernel %s unavailable (%s): %s", src, e, what)
        return None


def _function(src: str, name: str, argtypes: list, what: str):
    """The C function `name` of csrc/`src` with its argument types, and its library; (None, None)
    where it cannot be built (logged: `what` falls back)."""
    lib = _load(src, what)
    if lib is None:
        return None, None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn, lib


_I64, _I32, _PTR, _F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


@functools.cache
def paged_decode():
    """The C function paged_decode_attention with its argument types, or None."""
    fn, lib = _function("paged_attention.c", "paged_decode_attention",
                        [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I32, _I32, _I32, _I32, _I32,
                         _I64, _F32, _PTR], "decode attention uses torch ops (slower for long contexts)")
    if fn is None:
        return None
    limits = [ctypes.c_int() for _ in range(3)]
    lib.paged_decode_limits(*(ctypes.byref(x) for x in limits))
    fn.limits = tuple(x.value for x in limits)  # max query heads, head dim, block size
    return fn


@functools.cache
def prefill_attention():
    """The C function causal_prefill_attention (csrc/prefill_attention.c) with its argument
    types, or None. Its `vector_width` must divide the head size, up to `max_dim`."""
    fn, lib = _function("prefill_attention.c", "causal_prefill_attention",
                        [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I32, _I32, _I32, _F32, _PTR],
                        "prompt attention uses torch's SDPA")
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    limits = [ctypes.c_int() for _ in range(2)]
    lib.prefill_attention_limits(*(ctypes.byref(x) for x in limits))
    fn.vector_width, fn.max_dim = (x.value for x in limits)
    return fn


@functools.cache
def panel_gemm():
    """The C function panel_gemm (csrc/panel_gemm.c) with its argument types, or None. Its
    `panel_width` is the number of columns per packed panel."""
    fn, lib = _function("panel_gemm.c", "panel_gemm",
                        [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64],
                        "linear layers use MKL and oneDNN")
    if fn is None:
        return None
    width = ctypes.c_int()
    lib.panel_gemm_limits(ctypes.byref(width))
    fn.panel_width = width.value
    return fn


class Elementwise(NamedTuple):
    """The C functions of csrc/elementwise.c."""

    silu_mul: ctypes._CFuncPtr
    rotary: ctypes._CFuncPtr
    row_argmax_lse: ctypes._CFuncPtr
    write_kv: ctypes._CFuncPtr


@functools.cache
def elementwise() -> Elementwise | None:
    """The C functions of csrc/elementwise.c with their argument types, or None."""
    lib = _load("elementwise.c",
                "SiLU-and-multiply, rotary embeddings, KV writes and the sampler's argmax use torch ops")
    if lib is None:
        return None
    lib.silu_mul.argtypes, lib.silu_mul.restype = [_PTR, _I64, _I64, _I64, _PTR, _I64], None
    lib.rotary.argtypes, lib.rotary.restype = [_PTR, _I64, _I64, _I32, _I32, _PTR, _PTR, _I64], None
    lib.row_argmax_lse.argtypes, lib.row_argmax_lse.restype = [_PTR, _I64, _I64, _I64, _PTR, _PTR], None
    lib.write_kv.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR]
    lib.write_kv.restype = None
    return Elementwise(lib.silu_mul, lib.rotary, lib.row_argmax_lse, lib.write_kv)


@functools.cache
def rms_norm():
    """The C function rms_norm_rows (csrc/rms_norm.c) with its argument types, or None."""
    return _function("rms_norm.c", "rms_norm_rows", [_PTR, _I64, _PTR, _I64, _I64, _F32, _PTR, _I64],
                     "RMSNorm uses torch ops")[0]


@functools.cache
def decode_step():
    """The C function decode_step (csrc/decode_step.c) with its argument types, or None; `work`
    is decode_step_work (the floats of scratch a step of n rows needs)."""
    fn, lib = _function("decode_step.c", "decode_step",
                        [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR],
                        "decode steps run their layers from Python")
    if fn is None:
        return None
    lib.decode_step_work.argtypes, lib.decode_step_work.restype = [_PTR, _I64], _I64
    fn.work = lib.decode_step_work
    return fn


@functools.cache
def sample_rows():
    """The C function sample_rows (csrc/sampling.c) with its argument types, or None."""
    return _function("sampling.c", "sample_rows", [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR],
                     "random sampling uses torch ops (a sort per top-p row)")[0]


@functools.cache
def stream_copy():
    """The C function stream_copy (csrc/stream_copy.c) with its argument types, or None."""
    return _function("stream_copy.c", "stream_copy", [_PTR, _PTR, _I64], "KV frames land by memcpy")[0]
