"""The Ray actor that hosts one worker (prefill, decode or colocated)."""

from __future__ import annotations

import os

import ray

from pdcommon.config import ClusterConfig
from pdcommon.priority import restore_priority
from pdserve.launch.loop_host import LoopHost, quiet_logging
from pdserve.launch.placement import advertise_node_ip
from pdserve.launch.roles import serve_worker


@ray.remote(num_cpus=0, max_restarts=0)
class WorkerActor:
    def __init__(self, cfg: dict, role: str, worker_id: str, router_address: str) -> None:
        quiet_logging()
        config = ClusterConfig.model_validate(cfg)
        advertise_node_ip(config, role)
        restore_priority(config.process.nice)  # before any thread starts: they inherit it
        self.worker_id = worker_id
        self.host = LoopHost(lambda stop, started: serve_worker(config, role, worker_id, router_address, stop, started),
                             config.process.io_nice, config.process.event_loop, freeze_heap=True,
                             slice_us=config.process.serving_slice_us)

    def ready(self, timeout_s: float = 300.0) -> str:
        return self.host.wait(timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.host.stop()
