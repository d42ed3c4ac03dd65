"""`pdserve`'s command line: one parser per subcommand (pdserve/cli.py runs them)."""

from __future__ import annotations

import argparse

ROLES = ("prefill", "decode", "colocated")  # each a subcommand that runs one worker alone


def with_config(p: argparse.ArgumentParser, default: str | None = "configs/local.yaml") -> None:
    p.add_argument("--config", default=default, help="cluster YAML (default: %(default)s)")
    p.add_argument("--model", default=None, help="local Hugging Face model folder (overrides the YAML)")
    p.add_argument("--transport", choices=["zmq", "grpc"], default=None, help="KV transfer transport")


def build_parser() -> argparse.ArgumentParser:
    """The parser; the subcommand's name lands in `cmd`."""
    ap = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_up, _generate, _status, _bench, _profile, _simulate, _scale, _certs, _router, _workers, _demo):
        add(sub)
    return ap


def _up(sub) -> None:
    p = sub.add_parser("up", help="start router + pools (child processes on one host; Ray actors when joining "
                       "a Ray cluster or with --launcher ray)")
    with_config(p)
    p.add_argument("--port", type=int, default=None, help="router gRPC port (overrides the YAML)")
    p.add_argument("--http-port", type=int, default=None, help="router HTTP port (overrides the YAML)")
    p.add_argument("--control-port", type=int, default=None, help="router control-plane port (overrides the YAML)")
    p.add_argument("--ray-address", default=None, help="join this running Ray cluster (default: RAY_ADDRESS, "
                   "else the YAML, else an embedded local one)")
    p.add_argument("--launcher", choices=["auto", "ray", "process"], default="auto",
                   help="ray: router and workers as Ray actors (one host or many; Ray restarts a dead router); "
                   "process: this machine only, the router in this process and each worker a child process (no "
                   "Ray: starts in seconds); auto (default): ray when joining a Ray cluster (--ray-address, "
                   "RAY_ADDRESS or the YAML's ray.address), else process")


def _generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running router")
    p.add_argument("prompt")
    p.add_argument("--router", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", action="store_true", help="one JSON object per streamed message")


def _status(sub) -> None:
    p = sub.add_parser("status", help="pools, workers, load and KV usage")
    p.add_argument("--router", default="127.0.0.1:50051")


def _bench(sub) -> None:
    p = sub.add_parser("bench", help="load a running router; report TTFT/TPOT/ITL/E2E, throughput, goodput")
    p.add_argument("--router", default="127.0.0.1:50051", help="gRPC target")
    p.add_argument("--url", default=None, help="HTTP target (http://HOST:PORT), with --backend http")
    p.add_argument("--backend", choices=["grpc", "http"], default="grpc")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="every prompt shares this many leading tokens")
    p.add_argument("--request-rate", type=float, default=0.0, help="req/s (0: all at once)")
    p.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--sweep", default=None, help="comma-separated request rates, e.g. 1,2,4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as `vllm bench serve` sends")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", default="bench/out/serve",
                   help="folder for bench.json and the plots, or a .json path (the plots beside it)")


def _profile(sub) -> None:
    p = sub.add_parser("profile", help="measure a pool's engine steps; write the step-cost model (JSON + PNG)")
    with_config(p)
    p.add_argument("--role", choices=["prefill", "decode", "colocated"], default=None,
                   help="whose engine settings to profile (default: the config's first pool)")
    p.add_argument("--out", default="bench/out/profile.json")
    p.add_argument("--max-prompt", type=int, default=2048, help="longest prefill step measured (tokens)")
    p.add_argument("--max-batch", type=int, default=64, help="largest decode batch measured")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transfer", action="store_true",
                   help="skip the KV transfer measurement (disaggregated configs measure it over transfer.transport)")


def _simulate(sub) -> None:
    p = sub.add_parser("simulate", help="replay a trace through a simulated cluster: SLA planner vs best static split")
    p.add_argument("--trace", required=True, help="Azure CSV or Mooncake JSONL file, or a synthetic load: "
                   "poisson:rate=R,n=N[,prompt=P,output=O,spread=F], bursty:...,cv=C, diurnal:rate=R,duration=S,...")
    p.add_argument("--profile", default=None, help="step-cost profile (default: the benchmark model's, shipped)")
    p.add_argument("--decode-profile", default=None, help="a separate profile for decode workers")
    p.add_argument("--config", default=None, help="cluster YAML: its planner section, mode, routing and token budget")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default=None)
    p.add_argument("--workers", type=int, default=None, help="scale the trace's load to about this many workers")
    p.add_argument("--scale", type=float, default=None, help="or multiply its load by this factor")
    p.add_argument("--duration", type=float, default=None, help="only the trace's first S seconds")
    p.add_argument("--static", default=None, help="simulate this fixed split (P:D, or N colocated) instead")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="absolute TTFT SLO (default: 3x each request's unloaded prefill time)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="absolute TPOT SLO (default: 2x the batch-1 ITL at the request's context)")
    p.add_argument("--step-scale", default=None, metavar="P[,D]",
                   help="served steps take this many times the profile's: prompt steps P, decode steps D (measure "
                        "with one request: served TTFT / profiled prefill, served TPOT / profiled ITL)")
    p.add_argument("--seq-overhead-ms", type=float, default=None,
                   help="calibration: each sequence in a step costs this much more served than profiled (streaming "
                        "its token through worker, router and client)")
    p.add_argument("--routing", choices=["prefix_aware", "least_loaded"], default=None,
                   help="the router's policy (default: the config's, else prefix_aware)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--png", default=None, help="replicas over time (default: next to --json)")


def _scale(sub) -> None:
    p = sub.add_parser("scale", help="grow or drain a pool (internal control plane: needs cluster credentials)")
    p.add_argument("--router", default="127.0.0.1:50051", help="the router's public gRPC address")
    p.add_argument("--control", default=None, help="its control address (default: as the router reports it)")
    p.add_argument("--config", default=None, help="cluster YAML with the security section (default: the token "
                   "`pdserve up` keeps for this router, else PDSERVE_CLUSTER_TOKEN / PDSERVE_CERTS_DIR)")
    p.add_argument("--pool", choices=["prefill", "decode", "colocated"], required=True)
    p.add_argument("--replicas", type=int, required=True)


def _certs(sub) -> None:
    p = sub.add_parser("certs", help="make a CA and node certificate for security.mode: mtls")
    p.add_argument("--out", required=True, help="folder to write (keys are created 0600)")
    p.add_argument("--hosts", default="", help="extra host names or IPs for the certificate, comma-separated")
    p.add_argument("--days", type=int, default=365)


def _router(sub) -> None:
    p = sub.add_parser("router", help="run the router alone (Kubernetes)")
    with_config(p)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--control-port", type=int, default=None)


def _workers(sub) -> None:
    for role in ROLES:
        p = sub.add_parser(role, help=f"run one {role} worker alone (Kubernetes, `up --launcher process`)")
        with_config(p)
        p.add_argument("--router", default=None, help="the router's control plane HOST:PORT (default: "
                       "router.control_port from the config)")
        p.add_argument("--worker-id", default=None)


def _demo(sub) -> None:
    p = sub.add_parser("demo", help="start a local cluster and stream a few stories")
    with_config(p)
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--control-port", type=int, default=0)
