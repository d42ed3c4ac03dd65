"""The `pdserve` command line: up, generate, status, scale, the standalone components, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cli_args import ROLES, build_parser

if TYPE_CHECKING:
    from pdcommon.event_loop import EventLoopKind

DEMO_PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog was sad because"]


def _config(args: argparse.Namespace):
    from pdcommon.config import load_config

    overrides = {}
    if getattr(args, "model", None):
        overrides["model"] = args.model
    if getattr(args, "transport", None):
        overrides["transfer.transport"] = args.transport
    if getattr(args, "port", None) is not None:
        overrides["router.port"] = args.port
    if getattr(args, "http_port", None) is not None:
        overrides["router.http_port"] = args.http_port
    if getattr(args, "control_port", None) is not None:
        overrides["router.control_port"] = args.control_port
    if getattr(args, "ray_address", None):
        overrides["ray.address"] = args.ray_address
    try:
        cfg = load_config(args.config, **overrides)
    except (FileNotFoundError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        raise SystemExit(f"error: {e}") from e
    from engine.model_meta import ModelLoadError, resolve_model_path

    try:
        resolve_model_path(cfg.model)
    except ModelLoadError as e:
        raise SystemExit(f"error: {e}\n  use --model PATH or set 'model:' in {args.config or 'the config'}") from e
    return cfg


def _engine_process_env(args: argparse.Namespace, cfg, role: str) -> None:
    """A standalone engine process (a Kubernetes pod, `pdserve profile`) starts like a Ray worker:
    glibc reads its malloc tunables only at process start, so set them and start over. Only for a
    real command line: `main(argv)` from Python never replaces its caller."""
    from pdcommon.process_env import missing_from, worker_process_env

    want = worker_process_env(cfg, role)
    if not getattr(args, "command_line", False) or os.environ.get("PDSERVE_REEXEC") or not missing_from(os.environ,
                                                                                                        want):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "pdserve.cli", *sys.argv[1:]],
              {**os.environ, **want, "PDSERVE_REEXEC": "1"})


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def cmd_up(args: argparse.Namespace) -> int:
    """Start router + pools (Ray actors, or child processes: `_launcher`); print the router
    address; stop cleanly on Ctrl-C."""
    from pdcommon.security import SecurityConfigError
    from pdserve.launch.cluster import RayCluster

    cfg = _config(args)
    t0 = time.perf_counter()
    if _launcher(cfg, args.launcher) == "process":
        return _up_processes(cfg, t0)
    cluster = RayCluster(cfg)
    try:
        try:
            addr = cluster.start()
        except SecurityConfigError as e:
            raise SystemExit(f"error: {e}") from e
        _print_ready(cfg, addr, t0)
        _print_placement(addr)
        _print_endpoints(cfg, cluster.control_address, cluster.http_address)
        _wait_for_signal()
    finally:
        print("stopping...", flush=True)
        cluster.stop()
    return 0


def _launcher(cfg, asked: str) -> str:
    """`auto`: Ray when joining a running Ray cluster (--ray-address, RAY_ADDRESS or the YAML's
    `ray.address`, as on a `ray up` cluster), else child processes: on one host Ray's own start is
    most of `pdserve up` (about 6 s of ray.init here, against 4 s for the whole cluster as
    processes), and what it adds there, restarting a dead router, vLLM and SGLang do without."""
    from pdserve.launch.cluster import ray_address

    if asked != "auto":
        return asked
    return "ray" if ray_address(cfg) is not None else "process"


def _up_processes(cfg, t0: float) -> int:
    """`pdserve up` with processes: the router in this process, workers as its children."""
    from pdcommon.gc_heap import freeze_startup_heap
    from pdcommon.priority import lower_thread_priority, set_thread_slice
    from pdcommon.security import ClusterIdentity, SecurityConfigError, provision_token, remove_secret, token_path
    from pdserve.launch.cluster import pin_ports
    from pdserve.launch.processes import run_local

    set_thread_slice(cfg.process.serving_slice_us)  # before any thread starts: all inherit it
    pin_ports(cfg)
    r = cfg.router
    try:
        secret = provision_token(cfg.security, token_path(f"{r.advertise_host or r.host}:{r.port}"))
        ClusterIdentity.from_config(cfg.security)
    except SecurityConfigError as e:
        raise SystemExit(f"error: {e}") from e

    def ready(server) -> None:
        lower_thread_priority(cfg.process.io_nice)  # this thread is the router's event loop now
        _print_ready(cfg, server.address, t0, "worker processes, ")
        _print_workers(server.core.members.workers.values())
        _print_endpoints(cfg, server.control_address, server.core.http_address)
        freeze_startup_heap()  # this process serves the router until it exits (pdcommon/gc_heap.py)

    try:
        return _run_async(lambda stop: run_local(cfg, stop, ready), cfg.process.event_loop)
    finally:
        print("stopped", flush=True)
        remove_secret(secret)


def _print_endpoints(cfg, control_address: str, http_address: str) -> None:
    sec = cfg.security
    where = {"token": f"cluster token in {sec.token_file}", "mtls": f"certificates in {sec.certs_dir}",
             "none": "NO authentication"}[sec.mode]
    print(f"control plane at {control_address}  (security {sec.mode}: {where})", flush=True)
    if http_address:
        print(f"OpenAI-compatible HTTP at {http_address}/v1  (metrics: {http_address}/metrics)", flush=True)
    print("press Ctrl-C to stop", flush=True)


def _print_ready(cfg, addr: str, t0: float, how: str = "") -> None:
    pools = " + ".join(f"{cfg.pool(r).replicas} {r}" for r in cfg.roles)
    print(f"pdserve router ready at grpc://{addr}  ({pools} workers, {cfg.mode}, {cfg.transfer.transport} "
          f"transfer, {how}{time.perf_counter() - t0:.1f}s)", flush=True)


def _print_placement(router: str) -> None:
    """Where each worker landed (its advertised host: on a multi-host cluster, its node's IP)."""
    from pdcommon.client import RouterClient

    with RouterClient(router) as client:
        _print_workers(client.status().workers)


def _print_workers(workers) -> None:
    """One line per worker (anything with role, worker_id and address), by role then id."""
    for w in sorted(workers, key=lambda w: (w.role, w.worker_id)):
        print(f"  {w.role:9s} {w.worker_id:14s} on {w.address.rsplit(':', 1)[0]}  (serving {w.address})", flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from pdcommon.client import RouterClient, fields, make_request

    req = make_request(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                       top_p=args.top_p, top_k=args.top_k, stop=args.stop or None)
    ids: list[int] = []
    try:
        with RouterClient(args.router) as client:
            for msg in client.stream(req, timeout=args.timeout):
                ids += msg.token_ids
                if args.json:
                    final = bool(msg.finish_reason)
                    print(json.dumps({"request_id": msg.request_id, "text": msg.text, "token_ids": list(ids),
                                      "new_token_ids": list(msg.token_ids), "finish_reason": msg.finish_reason or None,
                                      "usage": fields(msg.usage) if final else None,
                                      "timings": fields(msg.timings) if final else None}), flush=True)
                else:
                    print(msg.text, end="", flush=True)
                    if msg.finish_reason:
                        t = msg.timings
                        u = msg.usage
                        print(f"\n[{msg.finish_reason}; {u.completion_tokens} tokens, {u.cached_tokens} cached; "
                              f"TTFT {t.ttft * 1e3:.1f} ms, TPOT {t.tpot * 1e3:.2f} ms]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from pdcommon.client import RouterClient

    with RouterClient(args.router) as client:
        st = client.status()
    print(f"model {st.model}  mode {st.mode}  transport {st.transport}  queued {st.queued_requests}  "
          f"http {st.http_address or '-'}")
    for p in st.pools:
        print(f"pool {p.role:8s} replicas {p.replicas} (target {p.target_replicas})")
    hdr = f"{'worker':14s} {'role':8s} {'state':9s} {'address':22s} {'run':>4s} {'wait':>4s} {'infl':>4s} " \
          f"{'served':>6s} {'busy':>5s} {'kv used':>8s} {'cached':>7s} {'hb age':>6s}"
    print(hdr)
    for w in st.workers:
        print(f"{w.worker_id:14s} {w.role:8s} {w.state:9s} {w.address:22s} {w.num_running:4d} {w.num_waiting:4d} "
              f"{w.inflight:4d} {w.requests_served:6d} {100 * w.engine_busy_fraction:4.0f}% {100 * w.kv_usage:7.1f}% "
              f"{w.cached_blocks:7d} {w.last_heartbeat_age_s:5.1f}s")
    if st.planner:
        plan = json.loads(st.planner)
        d = plan.get("decision")
        if d is None:
            print(f"planner {plan['mode']}: no decision yet")
        else:
            ago = time.time() - plan.get("decided_at_unix", time.time())
            print(f"planner {plan['mode']} ({'acting' if plan.get('acting') else 'recommending only'}), {ago:.0f} s "
                  f"ago: desired {d['desired']} (load alone asks {d['recommended']}); "
                  + "; ".join(f"{p}: {why}" for p, why in d["reasons"].items()))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Load a running router and report latency percentiles, throughput and goodput."""
    import math
    from pathlib import Path

    from pdserve.loadgen import Load, Workload, format_table, plot_report, plot_sweep, run_benchmark

    target = args.url if args.backend == "http" else args.router
    if not target:
        raise SystemExit("error: give --router HOST:PORT (grpc) or --url http://HOST:PORT (http)")
    # A folder (bench.json and the plots in it), or a .json path (the plots beside it, named after it).
    out = Path(args.out)
    json_path = out if out.suffix == ".json" else out / "bench.json"
    stem = json_path.stem + "_" if out.suffix == ".json" else ""
    out = json_path.parent
    out.mkdir(parents=True, exist_ok=True)
    try:
        workload = Workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                            args.shared_prefix_len, args.seed, args.temperature, args.top_p)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    reports = []
    for rate in rates:
        load = Load(rate if rate > 0 else math.inf, args.arrival, args.max_concurrency, args.warmup)
        print(f"rate {rate if math.isfinite(load.request_rate) else 'inf'} req/s:", file=sys.stderr)
        report = asyncio.run(run_benchmark(target, workload, load, args.backend, args.slo_ttft_ms, args.slo_tpot_ms))
        print(format_table(report))
        tag = f"rate{rate:g}" if args.sweep else "bench"
        plot_report(report, str(out / f"{stem}{tag}.png"))
        reports.append(report)
    result = reports[0] if not args.sweep else {"sweep": reports}
    json_path.write_text(json.dumps(result, indent=2))
    if args.sweep:
        plot_sweep(reports, str(out / f"{stem}goodput_vs_rate.png"))
    print(f"-> {json_path}")
    return 0 if all(r["summary"]["completed"] for r in reports) else 1


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile one pool's engine in this process; write the step-cost model (JSON) and its plot."""
    from pdserve.profile import add_transfer, plot, run_profile, summary

    cfg = _config(args)
    role = args.role or cfg.roles[0]
    _engine_process_env(args, cfg, role)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"profiling the {role} engine on {cfg.model} (max prompt {args.max_prompt}, max batch {args.max_batch})...",
          flush=True)
    model = run_profile(cfg.engine_config(role), max_prompt=args.max_prompt, max_batch=args.max_batch,
                        repeats=args.repeats)
    if cfg.mode == "disaggregated" and not args.no_transfer:
        add_transfer(model, cfg.transfer.transport if cfg.transfer.transport != "fake" else "zmq")
    model.save(out)
    plot(model, out.with_suffix(".png"))
    print(summary(model))
    print(f"wrote {out} and {out.with_suffix('.png')} in {model.meta['profile_seconds']:.0f} s")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.sim.command import main as simulate_main

    try:
        return simulate_main(args)
    except (ValueError, OSError) as e:
        print(f"pdserve simulate: {e}", file=sys.stderr)
        return 2


def _operator_identity(args: argparse.Namespace):
    """Cluster credentials for an operator command: from --config, else the token `pdserve up`
    left for this router on this machine, else the environment."""
    from pdcommon.config import load_config
    from pdcommon.security import CERTS_ENV, TOKEN_ENV, ClusterIdentity, token_path

    if args.config:
        return ClusterIdentity.from_config(load_config(args.config).security)
    sec = load_config(None).security
    saved = token_path(args.router.removeprefix("grpc://"))
    if saved.exists() and not os.environ.get(TOKEN_ENV):
        sec.token_file = str(saved)
    elif os.environ.get(CERTS_ENV) and not os.environ.get(TOKEN_ENV):
        sec.mode = "mtls"
    return ClusterIdentity.from_config(sec)


def cmd_scale(args: argparse.Namespace) -> int:
    """Scale through the internal control plane: the router's public API tells where it is."""
    import grpc

    from pdcommon.client import ControlClient, RouterClient
    from pdcommon.security import SecurityConfigError

    try:
        identity = _operator_identity(args)
        control = args.control
        if not control:
            with RouterClient(args.router) as client:
                control = client.status().control_address
        with ControlClient(control, identity) as cc:
            r = cc.scale(args.pool, args.replicas)
    except SecurityConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.pool}: {r.previous} -> {r.target}; adding {list(r.adding)}; draining {list(r.draining)}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from pdserve.certs import make_certs

    out = make_certs(args.out, [h for h in args.hosts.split(",") if h], args.days)
    print(f"wrote ca.pem, node.pem, node.key and ca.key to {out}; point security.certs_dir (or "
          f"PDSERVE_CERTS_DIR) at it with security.mode: mtls. Keep ca.key off the cluster.")
    return 0


def _run_async(coro, event_loop: EventLoopKind) -> int:
    from pdcommon import event_loop as loops
    from pdcommon.security import SecurityConfigError

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():  # a second signal: do not wait for the drain
                print("stopping now, without draining", file=sys.stderr, flush=True)
                os._exit(130)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await coro(stop)

    try:
        loops.run(main(), event_loop)
    except SecurityConfigError as e:  # a standalone component never makes up its own secret
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from pdcommon.priority import lower_thread_priority, set_thread_slice
    from router import serve

    cfg = _config(args)
    set_thread_slice(cfg.process.serving_slice_us)  # before any thread starts: all inherit it
    launcher = None
    if cfg.kubernetes is not None:  # pools are Deployments: scale them through the API server
        from pdserve.launch.kubernetes import KubernetesLauncher

        launcher = KubernetesLauncher(cfg.kubernetes)
        print(f"scaling pools through Kubernetes (namespace {launcher.namespace}: "
              f"{', '.join(launcher.deployment(r) for r in cfg.roles)})", flush=True)

    async def run(stop):
        started = asyncio.get_running_loop().create_future()
        started.add_done_callback(lambda f: print(f"router serving on {f.result()}", flush=True))
        started.add_done_callback(lambda f: lower_thread_priority(cfg.process.io_nice))
        started.add_done_callback(_freeze_heap)
        await serve(cfg, launcher, stop, started)

    return _run_async(run, cfg.process.event_loop)


def _cmd_worker(args: argparse.Namespace, role: str) -> int:
    import socket

    from pdcommon.priority import lower_thread_priority, set_thread_slice

    cfg = _config(args)
    _engine_process_env(args, cfg, role)
    # Before any thread starts: all inherit it, and the engine thread returns to the default.
    set_thread_slice(cfg.process.serving_slice_us)
    router_addr = args.router or cfg.router.control_target
    worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
    from pdserve.launch.processes import die_with_parent
    from pdserve.launch.roles import serve_worker

    die_with_parent()

    async def run(stop):
        started = asyncio.get_running_loop().create_future()
        started.add_done_callback(lambda f: print(f"{role} worker {worker_id} serving on {f.result()}", flush=True))
        # After start: the engine thread, started already, keeps its priority (pdcommon/priority.py).
        started.add_done_callback(lambda f: lower_thread_priority(cfg.process.io_nice))
        started.add_done_callback(_freeze_heap)
        await serve_worker(cfg, role, worker_id, router_addr, stop, started)

    return _run_async(run, cfg.process.event_loop)


def _freeze_heap(started: asyncio.Future) -> None:
    """Once a router or worker process serves, its start-up heap leaves the garbage collector's
    walks (pdcommon/gc_heap.py): this process serves one role until it exits."""
    if not started.cancelled() and started.exception() is None:
        from pdcommon.gc_heap import freeze_startup_heap

        freeze_startup_heap()


def cmd_demo(args: argparse.Namespace) -> int:
    """Start a local cluster, stream a few prompts through it, print answers and timings."""
    from pdcommon.client import RouterClient, make_request
    from pdserve.launch.cluster import RayCluster

    cfg = _config(args)
    print(f"starting a local cluster on {cfg.model}: 1 prefill + 1 decode worker ({cfg.transfer.transport})...",
          flush=True)
    t0 = time.perf_counter()
    with RayCluster(cfg) as cluster:
        print(f"router ready at grpc://{cluster.address} after {time.perf_counter() - t0:.1f}s\n", flush=True)
        with RouterClient(cluster.address) as client:
            for prompt in DEMO_PROMPTS:
                print(f"> {prompt}", end="", flush=True)
                final = None
                t_start = time.perf_counter()
                for msg in client.stream(make_request(prompt, max_tokens=args.max_tokens), timeout=120):
                    print(msg.text, end="", flush=True)
                    if msg.finish_reason:
                        final = msg
                wall = time.perf_counter() - t_start
                t, u = final.timings, final.usage
                print(f"\n  [{u.completion_tokens} tokens via {final.prefill_worker} -> {final.decode_worker}; "
                      f"TTFT {t.ttft * 1e3:.1f} ms (prefill {t.prefill * 1e3:.1f} ms), KV transfer "
                      f"{t.kv_transfer * 1e3:.1f} ms / {u.kv_transfer_bytes} B, TPOT {t.tpot * 1e3:.2f} ms, "
                      f"total {wall * 1e3:.0f} ms]\n", flush=True)
    print("cluster stopped.")
    return 0


COMMANDS = {"up": cmd_up, "generate": cmd_generate, "status": cmd_status, "bench": cmd_bench, "profile": cmd_profile,
            "simulate": cmd_simulate, "scale": cmd_scale, "certs": cmd_certs, "router": cmd_router, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = argv is None
    from pdcommon.logs import setup_logging

    setup_logging()
    if args.cmd in ROLES:
        return _cmd_worker(args, args.cmd)
    return COMMANDS[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
