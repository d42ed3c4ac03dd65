"""Compile proto/pdcommon/v1/*.proto into pdcommon/v1/ with grpc_tools, or check that the
committed generated files are current (`--check`, run by CI)."""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "pdcommon" / "v1"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.glob("pdcommon/v1/*.proto"))
    if not protos:
        return []
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *(str(p.relative_to(PROTO_ROOT)) for p in protos)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "pdcommon" / "v1").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if pdcommon/v1 is stale")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        committed = sorted(OUT.glob("*_pb2*.py*")) if OUT.exists() else []
        if args.check:
            names = {f.name for f in files}
            stale = [f.name for f in files if not (OUT / f.name).exists()
                     or not filecmp.cmp(f, OUT / f.name, shallow=False)]
            stale += [f.name for f in committed if f.name not in names]
            if stale:
                print(f"generated gRPC code is stale: {stale}; run `make proto`", file=sys.stderr)
                return 1
            print(f"proto check: {len(files)} generated files up to date")
            return 0
        OUT.mkdir(parents=True, exist_ok=True)
        for f in committed:
            f.unlink()
        for f in files:
            (OUT / f.name).write_bytes(f.read_bytes())
        print(f"wrote {len(files)} files to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
