"""Cluster configuration from YAML, validated at the edge with pydantic."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import typing
import warnings
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, create_model, model_validator

from engine.config import EngineConfig
from pdcommon.event_loop import EventLoopKind

log = logging.getLogger(__name__)

# router.local_prefill_max_tokens when unset (and no SLA planner): short prompts such as a chat
# turn's stay on their decode worker, where one 256-token step costs its batch about one
# prefill chunk, while long prompts, whose prefill would stall every stream there, go to the
# pool. The value bench/disagg_vs_colocated.py measured (issue 10, item 2).
DEFAULT_LOCAL_PREFILL_TOKENS = 256
# engine.prefill_chunk_size of the prefill pool when unset and the KV streams (TransferSection):
# a long prompt is computed in chunks of this many tokens, and each chunk's KV ships while the
# next is computed. On this machine a 2048-token prefill took 0.94-1.0x as long in 512-token
# chunks (engine alone, paired).
PREFILL_POOL_CHUNK = 512
STREAM_MIN_BYTES = 1 << 20  # transfer.stream_min_bytes where it is on by default


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _engine_section(name: str, overrides: bool) -> type[BaseModel]:
    """A pydantic model with EngineConfig's own fields (less `model`, which is cluster-wide), so the
    YAML edge and the engine share one schema. As per-pool overrides every field is optional."""
    hints = typing.get_type_hints(EngineConfig)
    fields: dict = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        fields[f.name] = (hints[f.name] | None, None) if overrides else (hints[f.name], f.default)
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


_EngineFields = _engine_section("EngineSection", overrides=False)
_EngineOverrides = _engine_section("EngineOverrides", overrides=True)


class EngineSection(_EngineFields):  # type: ignore[misc, valid-type]
    @model_validator(mode="after")
    def _engine_checks(self) -> EngineSection:
        # The engine's own checks (ranges, device) run at load time, not when a worker starts.
        EngineConfig(model="-", **self.model_dump())
        return self


class EngineOverrides(_EngineOverrides):  # type: ignore[misc, valid-type]
    def set_values(self) -> dict:
        """The keys this pool overrides. A null means "not overridden" (so the config survives a
        dump and re-validation on its way to a Ray actor); it cannot reset a key to null."""
        return self.model_dump(exclude_none=True)


class PoolSection(_Strict):
    replicas: int | None = Field(None, ge=0)
    # Bind address. On a multi-host Ray cluster use 0.0.0.0 and leave advertise_host unset: each
    # worker then advertises the IP of the node it landed on.
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    # Ray resources each worker of this pool asks for, e.g. {CPU: 2, pdserve_prefill: 1}: with the
    # node types of configs/ray/*.yaml, a custom resource places the pool on its own kind of node.
    # Empty: no placement (a worker may land on any node). `pdserve up` prints where each landed.
    resources: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    port: int = Field(0, ge=0, le=65535)  # 0: pick a free port
    transfer_port: int = Field(0, ge=0, le=65535)
    engine: EngineOverrides = Field(default_factory=EngineOverrides)  # per-pool overrides of the engine section


class PoolsSection(_Strict):
    total: int | None = Field(None, ge=2)
    ratio: str = "1:1"  # prefill:decode

    def split(self) -> tuple[int, int]:
        p, d = (float(x) for x in self.ratio.split(":"))
        if p <= 0 or d <= 0:
            raise ValueError(f"pools.ratio {self.ratio!r} must be two positive numbers 'P:D'")
        n_p = max(1, min(self.total - 1, round(self.total * p / (p + d))))
        return n_p, self.total - n_p


class RouterSection(_Strict):
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = Field(50051, ge=0, le=65535)  # the public API (Generate, Health, ClusterStatus)
    # The internal control plane (workers' Register and Heartbeat, Scale): a port of its own, so a
    # deployment can expose the public one alone. Bound on control_host (default: host).
    control_port: int = Field(50052, ge=0, le=65535)
    control_host: str | None = None
    # Decode workers' engine threads send tokens here over ZeroMQ (pdcommon/token_stream.py), on
    # control_host; workers reach it at the host they registered with. None: every token on the
    # gRPC stream (also what mutual TLS gets: this port is not encrypted).
    token_port: int | None = Field(50053, ge=0, le=65535)
    # Requests waiting for decode room; sized so a burst of several hundred streams queues
    # rather than getting 429s.
    queue_size: int = Field(4096, ge=0)
    request_timeout_s: float = Field(300.0, gt=0)
    routing: Literal["least_loaded", "prefix_aware"] = "prefix_aware"
    # Attempts after the first: a failed prefill moves to another prefill worker, a lost decode
    # worker's requests resume on a live pair from the tokens already sent. Bounded in time too.
    max_retries: int = Field(3, ge=0)
    retry_window_s: float = Field(60.0, gt=0)  # no new attempt this long after the first failure
    stall_timeout_s: float = Field(10.0, gt=0)  # longest wait for the next token of a decode stream
    # Disaggregated mode: a prompt of at most this many tokens is prefilled by the decode worker
    # that will stream it (Dynamo's conditional disaggregation), not by the prefill pool. A short
    # prompt then neither waits behind long prompts' chunks on a prefill worker nor ships its KV;
    # it costs the decode batch one longer step. 0: every prompt goes to the prefill pool.
    # Unset: DEFAULT_LOCAL_PREFILL_TOKENS, or 0 under the SLA planner (ClusterConfig._local_prefill).
    local_prefill_max_tokens: int | None = Field(None, ge=0)
    # A worker dropped as dead (not drained) that has not registered again after this long is
    # stopped and replaced through the launcher, keeping each pool at its target.
    replace_after_s: float = Field(5.0, ge=0)
    http_port: int | None = Field(8000, ge=0, le=65535)  # OpenAI-compatible HTTP + /metrics; None: off
    # Largest request (HTTP body, gRPC message) any component accepts; the same limit router <-> workers.
    max_request_bytes: int = Field(16 << 20, ge=1 << 16)
    # User API keys for the public API (HTTP Bearer, gRPC `authorization` metadata). Prefer
    # api_keys_file or the PDSERVE_API_KEYS environment variable: keys in a YAML get committed.
    api_keys: list[str] = Field(default_factory=list)
    api_keys_file: str | None = None
    protect_probes: bool = False  # /health, /metrics and gRPC Health need a key too

    @model_validator(mode="after")
    def _free_ports_together(self) -> RouterSection:
        # port 0 asks for a free port: unless also given, the control port is then a free one too.
        if self.port == 0 and "control_port" not in self.model_fields_set:
            self.control_port = 0
        if self.port == 0 and "token_port" not in self.model_fields_set:
            self.token_port = 0
        return self

    @property
    def control_target(self) -> str:
        """Where workers reach the control plane, as configured (port 0 until someone pins it)."""
        return f"{self.advertise_host or self.control_host or self.host}:{self.control_port}"


class TransferSection(_Strict):
    transport: Literal["zmq", "grpc", "fake"] = "zmq"
    timeout_s: float = Field(30.0, gt=0)
    # 4 MiB: frames small enough that hashing, the wire and landing overlap (a 16 MiB frame
    # serialised them), large enough that per-message costs stay small (bench/transfer.py).
    max_frame_bytes: int = Field(4 << 20, ge=1)
    # Encrypt KV on the wire with ZeroMQ CURVE (zmq transport). Every transfer is authorized by its
    # one-time key either way; CURVE also hides and protects the bytes from someone on the path.
    curve: bool = False
    # Transfers one sending peer may have open at a receiver at once (the rest are refused).
    max_transfers_per_peer: int = Field(64, ge=1)
    # A prompt computed in chunks ships its KV while the later chunks are computed: a part each
    # time this many bytes of full blocks are ready, so that only the last chunk's KV is left
    # between the first token and the second. 0: the whole KV after the first token. Unset: on
    # (1 MiB) where the engine computes on a GPU, off on CPU. There the transfer's copies and
    # checksums take the cores the prefill computes on: on this 2-core machine a 2048-token
    # prompt's second token came 1.8-2.0x the ITL after its first instead of 2.5-4.9x, but its
    # TTFT grew 15-24% (bench/transfer.py --only ttft pairs the two).
    stream_min_bytes: int | None = Field(None, ge=0)
    # zmq, workers on one host: the prefill worker's KV pool lives in shared memory (a memfd), and
    # a decode worker that can map it takes the KV's frames by reference and lands them from
    # there (transfer/shared_memory.py): one copy, no socket. Checksums and transfer keys apply as
    # on the wire. Other hosts, other PID namespaces (a pod each) and GPU pools use the socket.
    shared_memory: bool = True


class HeartbeatSection(_Strict):
    interval_s: float = Field(1.0, gt=0)
    # A worker silent this long is dropped. Seconds, not beats: a worker busy with a long step or a
    # burst of streams can send late. A dead one is usually noticed sooner, by its broken streams.
    timeout_s: float = Field(10.0, gt=0)

    @property
    def dead_after_s(self) -> float:
        return max(self.timeout_s, 2 * self.interval_s)


class SecuritySection(_Strict):
    """Cluster identity on the internal control plane (see pdcommon/security.py)."""
    # token: a shared secret on every internal call; mtls: mutual TLS with the cluster's CA; none:
    # nothing (explicit, logged). Standalone components refuse to start without their secret.
    mode: Literal["token", "mtls", "none"] = "token"
    token_file: str | None = None  # else the PDSERVE_CLUSTER_TOKEN environment variable
    certs_dir: str | None = None  # ca.pem, node.pem, node.key; else PDSERVE_CERTS_DIR


class ProcessSection(_Strict):
    # Added to the nice value of each component's serving threads (event loop, gRPC) once it has
    # started, so the engine's compute threads win the cores under load; 0: off. Not applied by
    # the in-process launcher, whose components share one event loop. Their work is short but on
    # every request's path: on 2 cores at 2 req/s of 512/64 requests (colocated, paired against
    # the engine alone on the same schedule), TTFT p50 was 1.20-1.37x the engine's at 10 and
    # 1.05-1.07x at 4, TPOT 1.07-1.23x and 0.99-1.07x.
    io_nice: int = Field(4, ge=0, le=19)
    # The scheduler slice serving processes ask for (Linux 6.12 on; pdcommon/priority.py): a
    # woken serving thread (a token for the router, the event loop) then takes a core from the
    # engine's team at once instead of after the team's own 1.4 ms slice. The engine thread and
    # its team keep the kernel's default. 0: the default for every thread.
    serving_slice_us: int = Field(100, ge=0, le=100_000)
    # The serving components' event loop (pdcommon/event_loop.py says what uvloop bought).
    event_loop: EventLoopKind = "uvloop"
    # Added to the nice value of the KV sender's and receiver's threads: hashing, copying and
    # landing KV, bulk work that can wait for the engine.
    kv_nice: int = Field(10, ge=0, le=19)
    # The nice value a Ray actor (router, worker) returns to when it starts: Ray starts worker
    # processes at 15, below the client and Ray's own daemons (see pdcommon/priority.py).
    nice: int = Field(0, ge=-20, le=19)
    # Start engine processes with glibc malloc keeping large blocks (see pdcommon.process_env):
    # fewer page faults per step, at the price of RSS staying at its peak.
    tune_malloc: bool = True
    # On SIGTERM (a pod going away, `kill`) a worker stops taking work, finishes what it holds for
    # up to this long, then leaves the router and exits. Keep it under Kubernetes'
    # terminationGracePeriodSeconds, which kills the pod after that.
    drain_timeout_s: float = Field(25.0, ge=0)
    # Present while the worker is registered with the router and not draining: a readiness
    # probe (`test -f`). `{worker_id}` in it is replaced (workers sharing a host). Unset: none.
    ready_file: str | None = None


class SchedulingSection(_Strict):
    """A colocated worker's token budget from a step-cost profile (`pdserve profile`): the largest
    prompt chunk whose step beside `decode_batch` decodes at `decode_context` tokens is predicted
    to take at most `target_step_ms`, never below the chunk that keeps prefill at half its best
    throughput. Without a profile, engine.max_num_batched_tokens holds as written."""

    profile: str | None = None
    target_step_ms: float | None = Field(None, gt=0)
    decode_batch: int = Field(8, ge=1)
    decode_context: int = Field(512, ge=1)

    @model_validator(mode="after")
    def _both(self) -> SchedulingSection:
        if (self.profile is None) != (self.target_step_ms is None):
            raise ValueError("scheduling: give both profile and target_step_ms, or neither")
        return self


class PoolLimits(_Strict):
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(64, ge=1)


class PlannerSection(_Strict):
    """How the pools size themselves (router/planner). `static` keeps the replicas above; `sla`
    sizes the prefill pool with a queueing model and the decode pool from the profile's ITL and
    KV capacity, so that `target_attainment` of requests meet both SLOs."""

    mode: Literal["static", "sla"] = "static"
    profile: str | None = None  # a step-cost profile (`pdserve profile`); sla needs one
    interval_s: float = Field(30.0, gt=0)
    target_attainment: float = Field(0.9, gt=0, lt=1)
    # The target holds over this window (an error budget): each interval plans for the target
    # less gain x what the window met above target + margin (never above the target). 0: every
    # interval plans for the target itself.
    attainment_window_s: float = Field(3600.0, ge=0)
    attainment_gain: float = Field(0.5, ge=0)
    attainment_margin: float = Field(0.01, ge=0, lt=0.1)
    # Absolute SLOs; unset, each request's own: TTFT (queueing included) <= ttft_slo_factor x its
    # unloaded prefill time, TPOT <= tpot_slo_factor x the batch-1 ITL at its context.
    ttft_slo_s: float | None = Field(None, gt=0)
    tpot_slo_s: float | None = Field(None, gt=0)
    ttft_slo_factor: float = Field(3.0, gt=1)
    tpot_slo_factor: float = Field(2.0, gt=1)
    forecaster: Literal["constant", "trend", "steady"] = "steady"
    prefill: PoolLimits = Field(default_factory=PoolLimits)
    decode: PoolLimits = Field(default_factory=PoolLimits)
    max_total_workers: int | None = Field(None, ge=2)
    startup_s: float = Field(30.0, ge=0)  # how far ahead to forecast: a new worker serves after this
    # Scale up at once; scale down to the highest recommendation of the last window, at most
    # max_scale_down_fraction of a pool per interval, never within cooldown_s of a change to it,
    # and only while the plan at (1 + hysteresis) x the load still needs fewer workers.
    # The window's highest plan stands in for the next 10 minutes' (a scale-up within 10 minutes
    # of a scale-down is an oscillation). Under a load with no trend, the next H seconds peak
    # above the last W with odds H / (W + H) before the hysteresis margin: 1/2 for a 600 s
    # window, 2/5 for 900 s, 1/3 for 1200 s. On the Azure code trace at 512 workers, 600 s
    # reversed four scale-downs and met 89.1% of a 90% target; 900 s reversed one (decode, 123
    # -> 93 -> 100 two minutes later: the peak of 123 was 930 s old) and met 91.1%; 1200 s none,
    # 91.6%, for 1-2 points of worker-hours on Azure. "Under a load with no trend": one that
    # rises (the window's last quarter over the quarter before, router/planner/sla.py RISE_Z)
    # holds every pool.
    scale_down_window_s: float = Field(1200.0, ge=0)
    cooldown_s: float = Field(120.0, ge=0)
    max_scale_down_fraction: float = Field(0.25, gt=0, le=1)
    hysteresis: float = Field(0.15, ge=0)
    # Scale up only for a plan more than this share above the pool (one worker more is always
    # past it below 1 / tolerance workers), or for a pool too small to keep up at all: the band
    # a Kubernetes autoscaler keeps (10%) on the way up. Without it, a plan one worker above a
    # pool just shrunk to the window's highest plan reversed the scale-down: on the Azure code
    # trace at 64 workers prefill went 54 -> 42 at 37 minutes and 42 -> 43 at 38.5.
    scale_up_tolerance: float = Field(0.05, ge=0, lt=1)
    min_samples: int = Field(20, ge=1)  # fewer completed requests in an interval: no latency correction

    @model_validator(mode="after")
    def _needs_profile(self) -> PlannerSection:
        if self.mode == "sla" and self.profile is None:
            raise ValueError("planner.mode sla needs planner.profile (make one with `pdserve profile`)")
        for name in ("prefill", "decode"):
            lim = getattr(self, name)
            if lim.min_replicas > lim.max_replicas:
                raise ValueError(f"planner.{name}: min_replicas {lim.min_replicas} > max_replicas {lim.max_replicas}")
        return self


class RaySection(_Strict):
    # None: start an embedded local instance; "auto": join the cluster this node belongs to (the
    # router actor then runs on the node where `pdserve up` runs, so its address is that node's).
    address: str | None = None
    # This node's address for Ray. The embedded instance stays on loopback; joining a multi-host
    # cluster, null lets Ray take the node's own address (or name it here).
    node_ip_address: str | None = "127.0.0.1"
    num_cpus: int | None = None


class KubernetesSection(_Strict):
    """Present: `pdserve router` scales the pools (`pdserve scale`, the planner) by patching the
    scale subresource of their Deployments (pdserve/launch/kubernetes.py). Worker ids are pod
    names (`--worker-id $(WORKER_NAME)`, the pod's name), so the router can mark the pods it drained for deletion."""
    namespace: str | None = None  # None: the pod's own namespace (in-cluster), else the kubeconfig's
    kubeconfig: str | None = None  # None: the pod's service account (in-cluster)
    deployments: dict[str, str] = Field(default_factory=lambda: {
        "prefill": "pdserve-prefill", "decode": "pdserve-decode", "colocated": "pdserve-colocated"})
    request_timeout_s: float = Field(10.0, gt=0)


class ClusterConfig(_Strict):
    model: str = "../shared/models/stories260K"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineSection = Field(default_factory=EngineSection)
    router: RouterSection = Field(default_factory=RouterSection)
    prefill: PoolSection = Field(default_factory=PoolSection)
    decode: PoolSection = Field(default_factory=PoolSection)
    # Colocated mode only: workers that run both phases.
    colocated: PoolSection = Field(default_factory=lambda: PoolSection(replicas=2))
    pools: PoolsSection | None = None
    transfer: TransferSection = Field(default_factory=TransferSection)
    heartbeat: HeartbeatSection = Field(default_factory=HeartbeatSection)
    security: SecuritySection = Field(default_factory=SecuritySection)
    process: ProcessSection = Field(default_factory=ProcessSection)
    scheduling: SchedulingSection = Field(default_factory=SchedulingSection)
    planner: PlannerSection = Field(default_factory=PlannerSection)
    ray: RaySection = Field(default_factory=RaySection)
    kubernetes: KubernetesSection | None = None

    @model_validator(mode="after")
    def _pool_sizes(self) -> ClusterConfig:
        if self.pools is not None and self.pools.total is not None:
            if self.prefill.replicas is not None or self.decode.replicas is not None:
                raise ValueError("give either pools.total with pools.ratio or explicit replicas, not both")
            self.prefill.replicas, self.decode.replicas = self.pools.split()
        self.prefill.replicas = 1 if self.prefill.replicas is None else self.prefill.replicas
        self.decode.replicas = 1 if self.decode.replicas is None else self.decode.replicas
        return self

    @model_validator(mode="after")
    def _local_prefill(self) -> ClusterConfig:
        """Conditional disaggregation is on unless the SLA planner sizes the pools: it sizes the
        prefill pool for every prompt's prefill and the decode pool for decode steps alone, so
        short prompts computed by decode workers would be planned on the wrong pool."""
        r = self.router
        if r.local_prefill_max_tokens is None:
            r.local_prefill_max_tokens = 0 if self.planner.mode == "sla" else DEFAULT_LOCAL_PREFILL_TOKENS
        elif r.local_prefill_max_tokens and self.planner.mode == "sla" and self.mode == "disaggregated":
            raise ValueError("router.local_prefill_max_tokens > 0 does not go with planner.mode sla: the planner "
                             "sizes the prefill pool for every prompt; set it to 0 (or leave it unset)")
        return self

    @model_validator(mode="after")
    def _kv_compatible(self) -> ClusterConfig:
        """KV moves prefill -> decode block by block: both pools must lay blocks out alike."""
        if self.mode == "disaggregated":
            p, d = self.engine_config("prefill"), self.engine_config("decode")
            for key in ("dtype", "block_size"):
                if getattr(p, key) != getattr(d, key):
                    raise ValueError(f"prefill.engine.{key} ({getattr(p, key)}) and decode.engine.{key} "
                                     f"({getattr(d, key)}) differ; KV blocks must have one layout in both pools")
        return self

    def engine_config(self, role: str) -> EngineConfig:
        values = {**self.engine.model_dump(), **self.pool(role).engine.set_values()}
        if role == "prefill" and values.get("prefill_chunk_size") is None and self.kv_stream_min_bytes:
            values["prefill_chunk_size"] = PREFILL_POOL_CHUNK
        if role == "prefill" and self.mode == "disaggregated":
            values["kv_shared_memory"] = values.get("kv_shared_memory") or (
                self.transfer.shared_memory and self.transfer.transport == "zmq")
        return EngineConfig(model=self.model, **values)

    @property
    def kv_stream_min_bytes(self) -> int:
        """transfer.stream_min_bytes, its default resolved (0: the KV does not stream)."""
        if self.transfer.stream_min_bytes is not None:
            return self.transfer.stream_min_bytes
        device = self.prefill.engine.set_values().get("device", self.engine.device)
        return 0 if device == "cpu" else STREAM_MIN_BYTES

    def pool(self, role: str) -> PoolSection:
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]

    @property
    def roles(self) -> tuple[str, ...]:
        """The pools this mode runs."""
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")


# Keys that older configs may still carry: dotted path -> new dotted path (None: no longer used).
DEPRECATED_KEYS: dict[str, str | None] = {"transfer.hwm": None}


def _pop(data: dict, dotted: str) -> tuple[bool, object]:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.get(part)
        if not isinstance(node, dict):
            return False, None
    return (True, node.pop(leaf)) if leaf in node else (False, None)


def set_dotted(data: dict, dotted: str, value: object) -> None:
    """data["a"]["b"] = value for dotted "a.b", creating sections on the way."""
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _migrate(data: dict) -> None:
    for old, new in DEPRECATED_KEYS.items():
        found, value = _pop(data, old)
        if not found:
            continue
        if new is None:
            warnings.warn(f"config key {old!r} is no longer used and is ignored; remove it", DeprecationWarning,
                          stacklevel=3)
        else:
            warnings.warn(f"config key {old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3)
            set_dotted(data, new, value)


def load_config(path: str | Path | None = None, **overrides) -> ClusterConfig:
    """Read YAML (relative model paths resolve against the working directory) and apply
    dotted overrides such as {"model": ..., "transfer.transport": "grpc"}. An override of None
    sets the key to null (e.g. "router.http_port": None turns HTTP off)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if str(path) == "-":  # on standard input (`up --launcher process` hands its workers its own)
            text = sys.stdin.read()
        elif not p.exists():
            raise FileNotFoundError(f"config file {p} not found")
        else:
            text = p.read_text()
        # ${VAR} in the YAML expands from the environment (e.g. the pod IP under Kubernetes).
        data = yaml.safe_load(os.path.expandvars(text)) or {}
    _migrate(data)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    cfg = ClusterConfig.model_validate(data)
    # Workers may run with another working directory (Ray actors, pods): pin the model path now.
    model = Path(cfg.model).expanduser()
    if model.exists():
        cfg.model = str(model.resolve())
    if cfg.scheduling.profile is not None:
        _budget_from_profile(cfg)
    return cfg


def _budget_from_profile(cfg: ClusterConfig) -> None:
    """Resolve scheduling.profile into the colocated pool's token budget, here at the edge, so
    that workers (Ray actors, pods) receive a plain number and need not read the file."""
    from pdcommon.step_cost import StepCostModel

    sch = cfg.scheduling
    if cfg.mode != "colocated":
        warnings.warn("scheduling.profile sets a colocated worker's token budget; this cluster is disaggregated "
                      "(prefill workers run no decodes beside their prompts), so it is not used", stacklevel=3)
        return
    if "max_num_batched_tokens" in cfg.engine.model_fields_set or \
            "max_num_batched_tokens" in cfg.colocated.engine.model_fields_set:
        raise ValueError("give either engine.max_num_batched_tokens or scheduling.profile with target_step_ms, "
                         "not both: the profile chooses the budget")
    model = StepCostModel.load(Path(sch.profile).expanduser())
    _check_profile_matches(model, cfg)
    budget, why = model.choose_budget(sch.target_step_ms / 1e3, sch.decode_batch, sch.decode_context)
    cfg.colocated.engine.max_num_batched_tokens = budget
    log.info("colocated token budget %d from %s: %s", budget, sch.profile, why)


def _check_profile_matches(model, cfg: ClusterConfig) -> None:
    from engine.model_meta import model_spec, read_json, resolve_model_path

    try:
        path = resolve_model_path(cfg.model)
        spec = model_spec(read_json(path / "config.json"), path)
    except Exception:  # the model's own errors come when it loads; the profile check is advisory
        return
    ours = {"hidden_size": spec.hidden_size, "num_layers": spec.num_layers, "vocab_size": spec.vocab_size}
    theirs = {k: model.meta.get(k) for k in ours}
    if theirs != ours:
        raise ValueError(f"scheduling.profile {cfg.scheduling.profile} was made for another model ({theirs}); "
                         f"this config serves {cfg.model} ({ours}). Run `pdserve profile` for it")
    threads = cfg.engine_config("colocated").num_threads
    if threads and model.meta.get("threads") not in (None, threads):
        warnings.warn(f"scheduling.profile was measured with {model.meta['threads']} thread(s); colocated workers "
                      f"run {threads}: its step times will be off", stacklevel=4)
