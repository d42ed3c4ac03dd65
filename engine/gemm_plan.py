"""Which GEMM kernel serves which linear layer at which row count (EngineConfig.cpu_gemm).

"auto", the default, measures at load: for each weight shape of the model, each kernel the layer
can hold (engine/linear.py) runs a few row counts from one row (decode) up to the token budget,
and every row count goes to the fastest at the nearest one measured. No fixed choice is right on
every host: on an AMD EPYC (AVX2) the native panel GEMM led at every row count, while on an Intel
Xeon (AVX-512) it was 1.1-1.8x slower than MKL everywhere, and a 50M-model prompt prefilled at
0.7x transformers' speed with it (1.0x with MKL and oneDNN). The fixed layouts stay for
comparison and for memory: "native", "both", "onednn", "mkl"."""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import defaultdict

import torch
from torch import nn

from engine import gemm_times
from engine.linear import ONEDNN_MAX_ROWS, UNBOUNDED, Linear, gemm_rows

log = logging.getLogger(__name__)

# Row counts measured; each serves the row counts up to the geometric middle between it and the
# next one, and the largest measured serves everything above it. Dense at decode sizes, where
# libraries switch kernels from one row count to the next: MKL ran one row fastest and two rows
# slowest of all (a 2-sequence decode step of the 50M model 11.2 ms against oneDNN's 9.8 on the
# Intel host, while one sequence took 7.4 against 9.3), so 1 and 2 must not share a measurement.
# And at prompt sizes, each doubling from 256: with 256 and 1024 alone, 512 rows (the geometric
# middle) took 256's winner, the native kernel, which at 512 rows ran the 50M model's o_proj 15%
# and qkv 5% slower than oneDNN on the Intel host; and 2048 took 1024's, MKL, 4% behind oneDNN
# on gate_up there.
POINTS = (1, 2, 4, 8, 16, 64, 256, 512, 1024, 2048)
# Layers measured, in model order: as many as hold this many bytes of weights (and one of each
# shape), so that a big model's layers do not all hold three copies at once.
PROBE_BYTES = 512 << 20
MARGIN = 1.03  # a kernel later in KERNEL_ORDER must be this much faster to take a row count
KERNEL_ORDER = ("mkl", "onednn", "native")  # MKL's copy is always there and its call is cheapest
MAX_PASS_S = 0.1  # stop measuring once the next row count's passes would take longer than this
# From this many rows a GEMM is compute-bound: whether its weights are still cached from a
# neighbour's call no longer matters, and one layer per shape is timed, not a pass over them all.
# Timed as whole passes, the 50M model's prompt-sized rows (256 and up) cost more than
# MAX_PASS_S, so 64 rows were the largest measured and decided 2048-row prompts, where the
# kernels differ most: on an Intel Xeon the native kernel, 5% ahead at 64 rows, ran 2048 1.4x
# slower than MKL.
ONE_LAYER_ROWS = 256
REPEATS = 2


def choose_gemm_layout(requested: str, dtype: str, device: torch.device) -> str:
    """The layout `requested` resolves to here: the native panel GEMM needs fp32 on the CPU and a
    C compiler that built it (else "both" is tried); oneDNN packing needs oneDNN, the CPU and
    fp32, or bf16 on a CPU with oneDNN's bf16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    AVX2 hosts have neither, and packing there raises). "auto" measures whatever of them is left."""
    if device.type != "cpu":
        return "mkl"
    if requested == "native":
        from engine.kernels import panel_gemm

        if dtype == "float32" and panel_gemm() is not None:
            return "native"
        requested = "both"
    if requested == "auto" or onednn_packs(dtype):
        return requested
    return "mkl"


def onednn_packs(dtype: torch.dtype | str) -> bool:
    dtype = str(dtype).removeprefix("torch.")
    return dtype in ("float32", "bfloat16") and torch.backends.mkldnn.is_available() and (
        dtype == "float32" or torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(net: nn.Module, layout: str, max_rows: int, logits_rows: int, keep: bool = True,
                 ) -> dict[str, str]:
    """Give the linear layers their copies and routes for `layout`; with "auto", measured here for
    up to `max_rows` rows (the token budget; `logits_rows` for the LM head), and with `keep` merged
    with earlier starts' times (tune). Returns the routes per weight shape, as `describe` writes them."""
    linears = [m for m in net.modules() if isinstance(m, Linear)]  # model order: layer by layer, LM head last
    groups: dict[tuple, list[Linear]] = defaultdict(list)
    for m in linears:
        groups[shape_of(m)].append(m)
    with torch.inference_mode():
        source = ""
        if layout == "auto":
            source = tune(linears, getattr(net, "lm_head", None), max_rows, logits_rows, keep=keep)
        for layers in groups.values():
            for m in layers:
                if layout == "native":
                    m.pack_panels()
                elif layout in ("both", "onednn"):
                    m.pack(keep_mkl=layout == "both")
            _warm_onednn(layers[0])
    routes = {f"{k}x{n}": describe(layers[0]) for (k, n, _, _), layers in groups.items()}
    log.info("GEMM routes (%s%s): %s", layout, f", {source}" if source else "", routes)
    return routes


def shape_of(m: Linear) -> tuple:
    return (m.in_features, m.out_features, m.bias is not None, m.weight_t.dtype)


def tune(order: list[Linear], lm_head: Linear | None, max_rows: int, logits_rows: int, keep: bool = False) -> str:
    """Route every weight shape by measuring passes over the model's linear layers, as a step
    runs them: each layer's own weights have left the caches by its next call, as they have in a
    step, and that decides small row counts (a layer timed alone ran from cache, and its winner
    lost whole decode steps by 15-20%). The probe is every layer up to PROBE_BYTES of weights
    (at least one per shape), given all copies; the others get only the copies they are routed to.
    `order`: the linear layers in the order a step calls them; `lm_head` (one of them, or None) is
    measured only up to `logits_rows`. With `keep`, the times merge with those of earlier starts
    on this host (engine/gemm_times.py), which decide alone once settled. Returns where the
    times came from."""
    probe, seen, total = [], set(), 0
    for m in order:
        nbytes = m.weight_t.numel() * m.weight_t.element_size()
        if shape_of(m) not in seen or total + nbytes <= PROBE_BYTES:
            probe.append(m)
            seen.add(shape_of(m))
            total += nbytes
    limits = {shape_of(m): logits_rows if m is lm_head else max_rows for m in probe}
    method = (POINTS, ONE_LAYER_ROWS, MAX_PASS_S, PROBE_BYTES, REPEATS)  # what the times mean
    path = gemm_times.times_path([shape_name(m) for m in probe], [limits[shape_of(m)] for m in probe],
                                 method) if keep else None
    starts, times = gemm_times.load(path) if path else (0, {})
    source = f"kept from {starts} starts"
    if starts < gemm_times.SETTLED:
        for m in probe:
            _add_copies(m, KERNEL_ORDER)
        times = gemm_times.merge(times, _measure_points(probe, limits))
        source = "measured" if path is None else f"measured, merged with {starts} earlier starts"
        if path is not None:
            gemm_times.save(path, starts + 1, times)
    routes: dict = {}  # every layer of a shape takes the same routes: worked out once
    body = {shape_name(m) for m in order if m is not lm_head}
    prefer = prompt_kernels({name: times[name] for name in body if name in times})
    for m in order:
        _route(m, times.get(shape_name(m), {}), logits_rows if m is lm_head else max_rows, routes,
               None if m is lm_head else prefer)
    return source


def _measure_points(probe: list[Linear], limits: dict[tuple, int]) -> gemm_times.Times:
    """Per shape name, row count and kernel: the time of a pass over the probe's layers of that
    shape, or from ONE_LAYER_ROWS rows on, of its first layer alone."""
    times: gemm_times.Times = defaultdict(dict)  # shape -> rows -> kernel -> s
    for i, rows in enumerate(POINTS):
        layers = _layers_at(probe, limits, rows)
        if not layers:
            break
        measured = measure(layers, rows)
        for m in layers:
            times[shape_name(m)][rows] = measured[shape_of(m)]
        if i + 1 < len(POINTS):  # stop where the next row count's passes would take too long
            nxt = POINTS[i + 1]
            per_layer = {shape: min(best.values()) / sum(shape_of(m) == shape for m in layers)
                         for shape, best in measured.items()}
            cost = sum(per_layer.get(shape_of(m), 0.0) for m in _layers_at(probe, limits, nxt)) * nxt / rows
            if cost > MAX_PASS_S:
                break  # the largest measured serves them
    return dict(times)


def _layers_at(probe: list[Linear], limits: dict[tuple, int], rows: int) -> list[Linear]:
    layers = [m for m in probe if rows <= max(limits[shape_of(m)], 1)]
    if rows >= ONE_LAYER_ROWS:
        first: dict[tuple, Linear] = {}
        for m in layers:
            first.setdefault(shape_of(m), m)
        layers = list(first.values())
    return layers


def _route(m: Linear, by_rows: dict[int, dict[str, float]], top: int, known: dict | None = None,
           prefer: dict[int, str] | None = None) -> None:
    """Route `m` by its shape's times (for row counts up to `top`, its largest call), giving it
    the copies the routes need; a kernel whose copy cannot be made here (times kept from a start
    that could build it) is left out. `known`: routes already worked out, by shape."""
    allowed = set(KERNEL_ORDER)
    known = {} if known is None else known
    while True:
        key = (shape_name(m), top, frozenset(allowed), tuple(sorted((prefer or {}).items())))
        if key not in known:
            known[key] = routes_for(by_rows, allowed, top, prefer) if by_rows else ([UNBOUNDED], ["mkl"])
        bounds, kernels = known[key]
        _add_copies(m, kernels)
        missing = set(kernels) - set(m.kernels())
        if not missing:
            break
        allowed -= missing
    m.route(bounds, kernels)
    m.drop_unrouted()


def shape_name(m: Linear) -> str:
    return f"{m.in_features}x{m.out_features}{'+bias' if m.bias is not None else ''}:{m.weight_t.dtype}"


def _add_copies(m: Linear, kernels) -> None:
    """Give `m` the copies of `kernels` it lacks and can hold here."""
    if "onednn" in kernels and m.packed is None and m.weight_t.device.type == "cpu" and onednn_packs(m.weight_t.dtype):
        m.pack(keep_mkl=True)
    if "native" in kernels and m.panels is None:
        m.pack_panels()


def measure(layers: list[Linear], rows: int) -> dict[tuple, dict[str, float]]:
    """Per weight shape and kernel, the best time of its layers' calls in a pass over `layers` at
    `rows` rows, every layer on that kernel; the kernels take turns, so that each sees the same
    noise of a shared machine."""
    xs = {(m.in_features, m.weight_t.dtype): torch.randn(rows, m.in_features, dtype=m.weight_t.dtype) for m in layers}
    kernels = {shape_of(m): m.kernels() for m in layers}
    best = {shape: dict.fromkeys(ks, float("inf")) for shape, ks in kernels.items()}
    for rep in range(REPEATS + 1):
        for kern in KERNEL_ORDER:
            spent: dict[tuple, float] = defaultdict(float)
            for m in layers:
                shape = shape_of(m)
                if kern in kernels[shape]:
                    t0 = time.perf_counter()
                    m.run(kern, xs[(m.in_features, m.weight_t.dtype)])
                    spent[shape] += time.perf_counter() - t0
            if rep:  # the first pass compiles oneDNN's kernel for the shape and warms up
                for shape, s in spent.items():
                    best[shape][kern] = min(best[shape][kern], s)
    return best


def pick(times: dict[str, float], first: str | None = None) -> str:
    """The fastest kernel, unless one earlier in KERNEL_ORDER (after `first`, when given) is within
    MARGIN of it (MKL's time, always measured, keeps this from being asked of an empty set)."""
    fastest = min(times.values())
    order = KERNEL_ORDER if first is None else (first, *(k for k in KERNEL_ORDER if k != first))
    return next(k for k in order if k in times and times[k] <= fastest * MARGIN)


def prompt_kernels(times: dict[str, dict[int, dict[str, float]]]) -> dict[int, str]:
    """Per prompt-sized row count (ONE_LAYER_ROWS and up) measured for every shape in `times`, the
    kernel whose pass over all the shapes is fastest: the one their routes prefer there, within
    MARGIN. Shape by shape, MKL kept the 50M model's prompts for the 3% margin its cheaper call
    earns at decode sizes, where oneDNN led by 2-4% per shape; in the step, every layer on
    oneDNN prefilled 512 and 2048 tokens 2.1-3.6% faster than every layer on MKL (two paired
    runs)."""
    out = {}
    points = set.intersection(*(set(t) for t in times.values())) if times else set()
    for p in sorted(x for x in points if x >= ONE_LAYER_ROWS):
        kernels = set.intersection(*(set(t[p]) for t in times.values()))
        if kernels:
            out[p] = min(sorted(kernels), key=lambda k: sum(t[p][k] for t in times.values()))
    return out


def routes_for(by_rows: dict[int, dict[str, float]], allowed: set[str], top: int,
               prefer: dict[int, str] | None = None) -> tuple[list[int], list[str]]:
    """Bounds and kernels for every row count up to `top` (the last kernel serves all above),
    runs of one kernel merged. A row count takes the times of its nearest measured one (point i
    serves up to the geometric middle with point i + 1). From ONE_LAYER_ROWS on, where a GEMM's
    time grows with the rows it computes, each kernel's time is scaled to the rows it runs: m for
    MKL and the native kernel, gemm_rows(m) for oneDNN, which pads to a few shapes per doubling
    (engine/linear.py). Without that, 513 rows and up went to oneDNN as measured at 1024, and a
    516-row step (a 512-token chunk beside 4 decodes) ran as 576: the 50M model's step cost 1.12x
    a 512-row one per token, where the native kernel runs its 516 rows at 512's rate."""
    points = sorted(by_rows)
    mids = [math.isqrt(a * b) for a, b in zip(points, points[1:], strict=False)]
    bounds: list[int] = []
    kernels: list[str] = []
    for rows in range(1, max(top, points[-1]) + 1):
        p = points[bisect.bisect_left(mids, rows)]
        costs = {k: t * (_rows_run(k, rows) / p if rows >= ONE_LAYER_ROWS else 1.0)
                 for k, t in by_rows[p].items() if k in allowed}
        kern = pick(costs, (prefer or {}).get(p))
        if kernels and kernels[-1] == kern:
            bounds[-1] = rows
        else:
            bounds.append(rows)
            kernels.append(kern)
    bounds[-1] = UNBOUNDED
    return bounds, kernels


def _rows_run(kernel: str, rows: int) -> int:
    return gemm_rows(rows) if kernel == "onednn" else rows


def describe(m: Linear, most: int = 6) -> str:
    """Routes as text, e.g. "1 mkl, 2-32 onednn, 33+ mkl" (past `most` parts, the first ones and
    a count: above a padded size's neighbourhood they alternate, two parts per oneDNN size)."""
    parts, low = [], 1
    for bound, kern in zip(m.route_bounds, m.route_kernels, strict=True):
        parts.append(f"{low}+ {kern}" if bound >= UNBOUNDED else f"{low} {kern}" if bound == low
                     else f"{low}-{bound} {kern}")
        low = bound + 1
    if len(parts) > most:
        parts = [*parts[:most - 1], f"... ({len(parts) - most + 1} more, to {parts[-1]})"]
    return ", ".join(parts)


def _warm_onednn(m: Linear) -> None:
    """Compile oneDNN's kernels for the decode-sized row counts it serves now, once per weight
    shape: the first step at each new batch size would otherwise stall ~1.7 ms per layer."""
    if m.packed is None:
        return
    x = torch.zeros(ONEDNN_MAX_ROWS, m.in_features, dtype=m.packed.dtype, device=m.packed.device)
    for rows in sorted({gemm_rows(r) for r in range(1, ONEDNN_MAX_ROWS + 1)}):
        if m.kernel_for(rows) == "onednn":
            m(x[:rows])

