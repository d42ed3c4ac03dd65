"""How long `pdserve up` takes to be ready on stories260K (issue #10, target 6: within 10 s), under
each launcher, measured from outside as a user sees it:

- from the command's start to the first completion served over HTTP (every pool registered:
  `up` prints its ready line only then);
- the time `up` itself reports on its ready line;
- and, for the record, a Python interpreter that only imports torch, the floor under any worker.

pdserve compiles nothing ahead of serving (no torch.compile, no compile cache), so every start is
a cold start; the first run of each launcher also pays a cold page cache, reported apart.

Writes bench/out/startup.json. Run: .venv/bin/python bench/startup.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pdserve.launch.ports import free_ports  # noqa: E402  (after the path: run as a script)

OUT = Path(__file__).resolve().parent / "out"
MODEL = ROOT.parent / "shared" / "models" / "stories260K"


def one_start(launcher: str) -> dict:
    port, http, control = free_ports("127.0.0.1", 3)
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--launcher", launcher, "--config", "configs/local.yaml",
           "--model", str(MODEL), "--port", str(port), "--http-port", str(http), "--control-port", str(control)]
    t0 = time.perf_counter()
    up = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        reported = None
        for line in up.stdout:
            if "router ready" in line:
                reported = float(line.rsplit(", ", 1)[1].rstrip("s)\n"))
                break
        if reported is None:
            raise RuntimeError(f"`pdserve up --launcher {launcher}` exited before it was ready (rc {up.wait()})")
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.load(resp)["choices"][0]["text"]
        served = time.perf_counter() - t0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)
    return {"ready_reported_s": reported, "first_completion_s": served}


def torch_import_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT / "startup.json")
    args = ap.parse_args()
    report: dict = {"model": str(MODEL), "cpus": os.cpu_count(), "target_s": 10.0,
                    "python_import_torch_s": torch_import_s(), "launchers": {}}
    for launcher in ("process", "ray"):
        runs = [one_start(launcher) for _ in range(args.runs + 1)]
        warm = runs[1:]
        row = {"first_run": runs[0], "runs": warm,
               "median_first_completion_s": statistics.median(r["first_completion_s"] for r in warm),
               "median_ready_reported_s": statistics.median(r["ready_reported_s"] for r in warm)}
        row["meets_target"] = row["median_first_completion_s"] <= report["target_s"]
        report["launchers"][launcher] = row
        print(f"{launcher:8s} ready (reported) {row['median_ready_reported_s']:.1f} s, first completion "
              f"{row['median_first_completion_s']:.1f} s (median of {len(warm)}; first run "
              f"{runs[0]['first_completion_s']:.1f} s)", flush=True)
    print(f"python -c 'import torch': {report['python_import_torch_s']:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
