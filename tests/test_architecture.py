"""The import graph runs one way: engine/ and transfer/ at the bottom (unaware of each other),
pdcommon above them, the workers and the router above that, pdserve (CLI, launchers) on top.
Function-level imports count too: a lazy import is still an arrow."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["engine", "transfer", "pdcommon", "prefill_worker", "decode_worker", "router", "pdserve"]
# What each package may import (besides itself and third-party code).
ALLOWED = {
    "engine": set(),
    "transfer": set(),
    "pdcommon": {"engine", "transfer"},
    "prefill_worker": {"engine", "transfer", "pdcommon"},
    "decode_worker": {"engine", "transfer", "pdcommon"},
    "router": {"engine", "pdcommon"},
    "pdserve": {"engine", "transfer", "pdcommon", "prefill_worker", "decode_worker", "router"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(path: Path, module: str, mods: dict[str, Path]) -> set[str]:
    """Project modules `module` imports anywhere in its file."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    # engine/__init__ re-exports lazily by name: those strings are imports too.
    if module == "engine":
        out |= {m for m in re.findall(r'"(engine\.\w+)"', path.read_text()) if m in mods}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, mods) for m, p in mods.items()}


def test_packages_import_only_downwards():
    bad = []
    for mod, deps in _graph().items():
        pkg = mod.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports that run up or sideways:\n" + "\n".join(sorted(bad))


def test_no_module_cycles():
    graph = _graph()
    # A package's __init__ only re-exports its own modules: edges into it stand for those modules.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d in graph.get(m, ()) and d.startswith(m + "."):
                continue  # a package importing its own submodule to re-export it
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    sys.setrecursionlimit(10_000)
    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_nothing_outside_engine_touches_the_kv_pool():
    """KV export and import go through the engine's seam (export_kv / land_kv), never `.kv.data`."""
    offenders = []
    for pkg in PACKAGES[1:] + ["bench"]:
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text()
            if re.search(r"\.kv\.(data|layers|block\b|write_block)|kv_cache\.data", text):
                offenders.append(str(f.relative_to(ROOT)))
    assert not offenders, offenders


def test_generated_code_floors_match_pyproject():
    """The generated modules refuse older runtimes; pyproject must not allow them."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    gen = (ROOT / "pdcommon" / "v1" / "router_pb2.py").read_text()
    pb = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)",
                   gen)
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'",
                         (ROOT / "pdcommon" / "v1" / "router_pb2_grpc.py").read_text())
    need_pb = tuple(int(x) for x in pb.groups())
    need_grpc = tuple(int(x) for x in grpc_gen.group(1).split("."))
    floor = {name: tuple(int(x) for x in v.split(".")) for name, v in
             re.findall(r'"(protobuf|grpcio)>=([\d.]+)"', pyproject)}
    assert floor["protobuf"] >= need_pb, f"pyproject allows protobuf {floor['protobuf']}, code needs {need_pb}"
    assert floor["grpcio"] >= need_grpc, f"pyproject allows grpcio {floor['grpcio']}, code needs {need_grpc}"
