"""Prometheus metrics in vLLM's style under the `pdserve:` prefix, served by the router.

Latency histograms are observed as requests stream through the router; pool, worker and
prefix-cache figures come from the workers' heartbeats, so nobody has to scrape each worker."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.core import RouterCore, slo_met
from router.request import RequestFailed, RequestState

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
# Per-worker figures from heartbeats; all but the last return to 0 (or their baseline) when idle.
WORKER_GAUGES = {"used_blocks": "KV blocks referenced (by live requests)",
                 "orphan_blocks": "KV block references held by no live request (a leak if not 0)",
                 "partial_transfers": "Incoming KV transfers still waiting for frames",
                 "peer_sockets": "Open connections to peers (KV senders: ZeroMQ sockets, gRPC lanes)",
                 "open_fds": "Open file descriptors of the worker process",
                 "rss_bytes": "Resident memory of the worker process",
                 "gc_frozen_objects": "Start-up objects frozen out of the garbage collector's walks (0: none)",
                 # Not a leak gauge: 0 means every decode worker gets this prefill worker's KV by socket.
                 "kv_shared_peers": "Decode workers that land this prefill worker's KV from its shared memory"}
_ITL = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
        0.75, 1.0, 2.5)
_BATCH = (1, 1.5, 2, 4, 8, 16, 32, 64, 128, 256)


class _ClusterCollector:
    """Gauges and counters read from router state at scrape time."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.retired = {"queries": 0, "hits": 0}  # prefix counters of workers that left
        core.members.on_leave.append(self._retire)

    def _retire(self, rec, why: str) -> None:
        if rec.status is not None:
            self.retired["queries"] += rec.status.prefix_queries
            self.retired["hits"] += rec.status.prefix_hits

    def describe(self):
        return []

    def collect(self):
        core = self.core
        running = GaugeMetricFamily("pdserve:num_requests_running", "Requests in model execution, per pool",
                                    labels=["pool"])
        waiting = GaugeMetricFamily("pdserve:num_requests_waiting", "Requests waiting, per pool (router: admission "
                                    "queue)", labels=["pool"])
        usage = GaugeMetricFamily("pdserve:kv_cache_usage_perc", "KV-cache usage per worker (1 = full)",
                                  labels=["pool", "worker"])
        replicas = GaugeMetricFamily("pdserve:num_replicas", "Active workers per pool", labels=["pool"])
        target = GaugeMetricFamily("pdserve:target_replicas", "Desired workers per pool", labels=["pool"])
        leaks = {name: GaugeMetricFamily(f"pdserve:worker_{name}", help_, labels=["pool", "worker"])
                 for name, help_ in WORKER_GAUGES.items()}
        inflight = GaugeMetricFamily("pdserve:router_inflight_entries", "Per-worker in-flight entries the router "
                                     "holds (0 when no request is in flight)")
        active = GaugeMetricFamily("pdserve:router_active_requests", "Requests the router is serving")
        # The engines' own time, per worker: busy seconds over wall time is how loaded an engine
        # is, and busy seconds over steps its step time, beside the ITL clients see.
        steps = CounterMetricFamily("pdserve:engine_steps", "Engine steps that ran the model, per worker",
                                    labels=["pool", "worker"])
        busy = CounterMetricFamily("pdserve:engine_busy_seconds", "Seconds the engine spent in those steps, per "
                                   "worker", labels=["pool", "worker"])
        queries = CounterMetricFamily("pdserve:prefix_cache_queries", "Prompt tokens looked up in prefix caches")
        hits = CounterMetricFamily("pdserve:prefix_cache_hits", "Prompt tokens found in prefix caches")
        q_total, h_total = self.retired["queries"], self.retired["hits"]
        for role in core.cfg.roles:
            workers = core.members.members(role)
            running.add_metric([role], sum(w.status.num_running for w in workers if w.status))
            waiting.add_metric([role], sum(w.status.num_waiting for w in workers if w.status))
            replicas.add_metric([role], len(core.members.active(role)))
            target.add_metric([role], core.targets.get(role, 0))
            for w in workers:
                if w.status is not None:
                    usage.add_metric([role, w.worker_id], w.status.kv_usage)
                    for name, fam in leaks.items():
                        fam.add_metric([role, w.worker_id], getattr(w.status, name))
                    steps.add_metric([role, w.worker_id], w.status.engine_steps)
                    busy.add_metric([role, w.worker_id], w.status.engine_busy_s)
                    q_total += w.status.prefix_queries
                    h_total += w.status.prefix_hits
        waiting.add_metric(["router"], core.waiting)
        inflight.add_metric([], sum(len(w.inflight) for w in core.members.workers.values()))
        active.add_metric([], len(core.active))
        queries.add_metric([], q_total)
        hits.add_metric([], h_total)
        yield from (running, waiting, usage, replicas, target, steps, busy, queries, hits, inflight, active,
                    *leaks.values())
        yield from _token_counters(core.admission.tokens)
        yield from _planner_gauges(core.planner_status)


def _token_counters(inbox):
    """Decode tokens that came straight from workers' engine threads (pdcommon/token_stream.py),
    and messages refused there (no open stream, or not signed with its key)."""
    if inbox is None:
        return
    received = CounterMetricFamily("pdserve:router_direct_token_messages", "Token messages from decode engine "
                                   "threads over the router's token port")
    refused = CounterMetricFamily("pdserve:router_direct_token_refused", "Token messages refused at the token "
                                  "port: no open stream, a bad signature, or malformed")
    received.add_metric([], inbox.received)
    refused.add_metric([], inbox.refused)
    yield from (received, refused)


def _planner_gauges(status: str):
    """The planner's last decision: desired against actual replicas, predicted against observed
    attainment."""
    if not status:
        return
    decision = json.loads(status).get("decision")
    if not decision:
        return
    desired = GaugeMetricFamily("pdserve:planner_desired_replicas", "The planner's replicas per pool", labels=["pool"])
    recommended = GaugeMetricFamily("pdserve:planner_recommended_replicas", "What the load alone asks for, per pool",
                                    labels=["pool"])
    for pool, n in decision["desired"].items():
        desired.add_metric([pool], n)
    for pool, n in decision["recommended"].items():
        recommended.add_metric([pool], n)
    attain = GaugeMetricFamily("pdserve:planner_attainment", "SLO attainment: the planner's prediction for the next "
                               "interval, and what the last interval observed", labels=["kind"])
    inputs = decision.get("inputs", {})
    for kind, value in {**{f"predicted_{k}": v for k, v in (inputs.get("predicted") or {}).items()},
                        "observed": inputs.get("attainment_observed")}.items():
        if value is not None:
            attain.add_metric([kind], value)
    yield from (desired, recommended, attain)


class RouterMetrics:
    def __init__(self, core: RouterCore) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between output tokens", buckets=_ITL,
                             registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY,
                             registry=r)
        self.kv = Histogram("pdserve:kv_transfer_seconds", "KV transfer prefill -> decode, from its header's "
                            "arrival to its last frame landed (wire, checks, landing); for KV streamed in parts "
                            "while the prompt was computed, the last part's, which the second token waits for",
                            buckets=_LATENCY, registry=r)
        self.decode_batch = Histogram("pdserve:request_decode_batch", "Mean number of sequences in a finished "
                                      "request's decode steps, as its decode worker counted them (requests without "
                                      "a decode step are not counted)", buckets=_BATCH, registry=r)
        self.kv_bytes = Counter("pdserve:kv_transfer_bytes", "KV bytes shipped prefill -> decode", registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens", registry=r)
        self.success = Counter("pdserve:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.failure = Counter("pdserve:request_failure", "Failed requests", ["code"], registry=r)
        self.slo = Counter("pdserve:request_slo", "Finished requests that met or missed their TTFT/TPOT SLO "
                           "(none: the request carried no SLO)", ["outcome"], registry=r)
        self.local_prefills = Counter("pdserve:local_prefills", "Finished requests of a disaggregated cluster whose "
                                      "prompt their decode worker prefilled (router.local_prefill_max_tokens)",
                                      registry=r)
        self.colocated = core.colocated
        r.register(_ClusterCollector(core))
        # The router process's own figures, as any Prometheus Python client exports them (vLLM's
        # /metrics too): process_cpu_seconds_total, process_resident_memory_bytes, open fds,
        # python_gc_collections_total per generation, python_info.
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)
        core.observers.append(self)

    # Observer hooks called by RouterCore.
    def on_start(self, st: RequestState) -> None:
        pass

    def on_token(self, st: RequestState, n: int, now: float) -> None:
        if st.last_token is not None and n > 0:
            gap = (now - st.last_token) / n
            for _ in range(n):
                self.itl.observe(gap)

    def on_finish(self, st: RequestState, msg) -> None:
        t = msg.timings
        self.ttft.observe(t.ttft)
        self.e2e.observe(t.e2e)
        if st.decode_batch:
            self.decode_batch.observe(st.decode_batch)
        if st.transfer_bytes:
            self.kv.observe(st.transfer_s)
            self.kv_bytes.inc(st.transfer_bytes)
        if not self.colocated and st.prefill_worker and st.prefill_worker == st.decode_worker:
            self.local_prefills.inc()
        self.prompt_tokens.inc(len(st.prompt))
        self.generation_tokens.inc(st.completion_tokens)
        self.success.labels(msg.finish_reason).inc()
        met = slo_met(st.slo, t.ttft, t.tpot)
        self.slo.labels("none" if met is None else "met" if met else "missed").inc()

    def on_abort(self, st: RequestState) -> None:
        """The client cancelled or disconnected: counted as vLLM does, finished_reason="abort"."""
        self.success.labels("abort").inc()

    def on_fail(self, st: RequestState | None, err: RequestFailed) -> None:
        self.failure.labels(err.code.name).inc()
