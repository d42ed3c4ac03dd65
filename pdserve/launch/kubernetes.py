"""The Launcher the router gets under Kubernetes: each pool is a Deployment, grown and shrunk
through its scale subresource, so `pdserve scale` and the planner work there as under Ray.

The router still decides who leaves and drains them first (router/scaling.py). Only then does
this backend mark the drained pod with `controller.kubernetes.io/pod-deletion-cost` (lowest goes
first) and lower the replica count, so the ReplicaSet removes that pod and not a busy one. The
pod gets SIGTERM and exits through the worker's own drain (pdcommon/worker_runtime.py).

Writes are read-modify-write on the scale object's resourceVersion: a concurrent writer
(`kubectl scale`, an HPA) makes the API server answer 409 Conflict and the change is retried on
a fresh read, never applied over someone else's. The RBAC this needs is in k8s/base/rbac.yaml:
get/update/patch on the two Deployments' scale subresource, and patch on pods.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pdcommon.config import KubernetesSection

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAINED_COST = "-1000000"  # below any default (0): the ReplicaSet deletes drained pods first
CONFLICT_RETRIES = 8
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubernetesLauncher:
    self_healing = True  # the Deployment recreates a dead pod: the router must not add another

    def __init__(self, cfg: KubernetesSection) -> None:
        from kubernetes import client, config  # optional dependency: pip install pdserve[kubernetes]

        if cfg.kubeconfig:
            api = config.new_client_from_config(config_file=cfg.kubeconfig)
            namespace = cfg.namespace or _kubeconfig_namespace(cfg.kubeconfig)
        else:
            conf = client.Configuration()
            config.load_incluster_config(client_configuration=conf)
            api = client.ApiClient(conf)
            namespace = cfg.namespace or IN_CLUSTER_NAMESPACE.read_text().strip()
        self.cfg, self.namespace = cfg, namespace
        self.apps, self.core = client.AppsV1Api(api), client.CoreV1Api(api)
        self._api_exception = client.ApiException
        self._lock = asyncio.Lock()  # one read-modify-write at a time from this router

    def deployment(self, role: str) -> str:
        return self.cfg.deployments[role]

    # ---- the Launcher protocol -------------------------------------------------------------
    async def add_worker(self, role: str) -> str:
        replicas = await self._change(role, +1)
        return f"{self.deployment(role)}#{replicas}"  # the pod's name is the ReplicaSet's to choose

    async def remove_worker(self, worker_id: str, role: str) -> None:
        await asyncio.to_thread(self._mark_for_deletion, worker_id)
        await self._change(role, -1)

    # ---- the API calls ---------------------------------------------------------------------
    def replicas(self, role: str) -> int:
        scale = self.apps.read_namespaced_deployment_scale(self.deployment(role), self.namespace,
                                                           _request_timeout=self.cfg.request_timeout_s)
        return scale.spec.replicas or 0

    async def _change(self, role: str, delta: int) -> int:
        async with self._lock:
            return await asyncio.to_thread(self._change_sync, role, delta)

    def _change_sync(self, role: str, delta: int) -> int:
        name, timeout = self.deployment(role), self.cfg.request_timeout_s
        for _ in range(CONFLICT_RETRIES):
            scale = self.apps.read_namespaced_deployment_scale(name, self.namespace, _request_timeout=timeout)
            scale.spec.replicas = max((scale.spec.replicas or 0) + delta, 0)
            try:
                # The read's metadata.resourceVersion rides along: a write in between is a 409.
                done = self.apps.replace_namespaced_deployment_scale(name, self.namespace, scale,
                                                                     _request_timeout=timeout)
            except self._api_exception as e:
                if e.status == 409:
                    log.info("scale of %s changed under us; reading it again", name)
                    continue
                raise
            log.warning("deployment %s scaled to %d", name, done.spec.replicas)
            return done.spec.replicas
        raise RuntimeError(f"deployment {name}: {CONFLICT_RETRIES} conflicting writes in a row; not scaled")

    def _mark_for_deletion(self, pod: str) -> None:
        body = {"metadata": {"annotations": {DELETION_COST: DRAINED_COST}}}
        try:
            self.core.patch_namespaced_pod(pod, self.namespace, body, _request_timeout=self.cfg.request_timeout_s)
        except self._api_exception as e:
            if e.status != 404:  # gone already: nothing to choose between
                raise
            log.info("pod %s is gone already", pod)


def _kubeconfig_namespace(path: str) -> str:
    from kubernetes import config

    _, active = config.list_kube_config_contexts(config_file=path)
    return (active or {}).get("context", {}).get("namespace") or "default"
