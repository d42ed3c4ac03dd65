"""Cluster configuration from YAML, validated at the edge with pydantic."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSection(_Strict):
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    block_size: int = Field(16, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int = Field(256 << 20, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    prefill_chunk_size: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(None, ge=1)
    num_threads: int | None = Field(1, ge=1)


class PoolSection(_Strict):
    replicas: int | None = Field(None, ge=0)
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = Field(0, ge=0, le=65535)  # 0: pick a free port
    transfer_port: int = Field(0, ge=0, le=65535)
    engine: dict = Field(default_factory=dict)  # per-pool overrides of the engine section


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
    port: int = Field(50051, ge=0, le=65535)
    queue_size: int = Field(256, ge=0)
    request_timeout_s: float = Field(300.0, gt=0)
    routing: Literal["least_loaded", "prefix_aware"] = "prefix_aware"
    max_retries: int = Field(1, ge=0)
    http_port: int | None = Field(8000, ge=0, le=65535)  # OpenAI-compatible HTTP + /metrics; None: off


class TransferSection(_Strict):
    transport: Literal["zmq", "grpc", "fake"] = "zmq"
    timeout_s: float = Field(30.0, gt=0)
    max_frame_bytes: int = Field(16 << 20, ge=1)
    hwm: int = Field(1024, ge=1)


class HeartbeatSection(_Strict):
    interval_s: float = Field(1.0, gt=0)
    # A worker silent for this long is dropped; default two intervals.
    timeout_s: float | None = Field(None, gt=0)

    @property
    def dead_after_s(self) -> float:
        return self.timeout_s or 2 * self.interval_s


class RaySection(_Strict):
    address: str | None = None  # None: start an embedded local instance; "auto": join a cluster
    node_ip_address: str = "127.0.0.1"
    num_cpus: int | None = None


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
    ray: RaySection = Field(default_factory=RaySection)

    @model_validator(mode="after")
    def _pool_sizes(self) -> ClusterConfig:
        if self.pools is not None and self.pools.total is not None:
            if self.prefill.replicas is not None or self.decode.replicas is not None:
                raise ValueError("give either pools.total with pools.ratio or explicit replicas, not both")
            self.prefill.replicas, self.decode.replicas = self.pools.split()
        self.prefill.replicas = 1 if self.prefill.replicas is None else self.prefill.replicas
        self.decode.replicas = 1 if self.decode.replicas is None else self.decode.replicas
        return self

    def engine_kwargs(self, role: str) -> dict:
        return {"model": self.model, **self.engine.model_dump(), **self.pool(role).engine}

    def pool(self, role: str) -> PoolSection:
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]

    @property
    def roles(self) -> tuple[str, ...]:
        """The pools this mode runs."""
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")


def load_config(path: str | Path | None = None, **overrides) -> ClusterConfig:
    """Read YAML (relative model paths resolve against the working directory) and apply
    dotted overrides such as {"model": ..., "transfer.transport": "grpc"}."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"config file {p} not found")
        # ${VAR} in the YAML expands from the environment (e.g. the pod IP under Kubernetes).
        data = yaml.safe_load(os.path.expandvars(p.read_text())) or {}
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    cfg = ClusterConfig.model_validate(data)
    # Workers may run with another working directory (Ray actors, pods): pin the model path now.
    model = Path(cfg.model).expanduser()
    if model.exists():
        cfg.model = str(model.resolve())
    return cfg
