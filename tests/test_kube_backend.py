"""The Kubernetes pool backend, with the real `kubernetes` client and a real `kubectl`, against
a small API-server fake (tests/kube_fake.py) that serves Deployments, their scale subresource
and Pods, and answers 409 to a write carrying a stale resourceVersion."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdcommon.config import KubernetesSection
from pdserve.launch.kubernetes import DELETION_COST, KubernetesLauncher
from tests.cluster_utils import ProcessCluster
from tests.kube_fake import FakeKube

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
NS = "pdserve-test"


@pytest.fixture
def kube(tmp_path):
    with FakeKube(NS) as k:
        k.add_deployment("pdserve-prefill", 1, "prefill")
        k.add_deployment("pdserve-decode", 2, "decode")
        for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
            k.add_pod(name, role)
        k.kubeconfig(tmp_path / "kubeconfig")
        yield k


def kubectl(tmp_path: Path, *args: str) -> str:
    out = subprocess.run(["kubectl", "--kubeconfig", str(tmp_path / "kubeconfig"), *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def replicas(tmp_path: Path, deployment: str) -> int:
    return int(kubectl(tmp_path, "get", "deployment", deployment, "-o", "jsonpath={.spec.replicas}"))


def test_backend_scales_the_deployment_and_marks_the_drained_pod(kube, tmp_path):
    launcher = KubernetesLauncher(KubernetesSection(kubeconfig=str(tmp_path / "kubeconfig")))
    assert launcher.namespace == NS and launcher.self_healing
    assert asyncio.run(launcher.add_worker("decode")) == "pdserve-decode#3"
    assert replicas(tmp_path, "pdserve-decode") == 3 and replicas(tmp_path, "pdserve-prefill") == 1
    asyncio.run(launcher.remove_worker("decode-1", "decode"))
    assert replicas(tmp_path, "pdserve-decode") == 2
    # The pod the router drained goes first; the other keeps the default cost.
    cost = kubectl(tmp_path, "get", "pod", "decode-1", "-o", "jsonpath={.metadata.annotations}")
    assert DELETION_COST in cost and "-1000000" in cost
    assert DELETION_COST not in kube.annotations("decode-0")
    # A pod that is gone already (deleted by hand) still lowers the count.
    asyncio.run(launcher.remove_worker("decode-9", "decode"))
    assert replicas(tmp_path, "pdserve-decode") == 1


VERBS = {"GET": "get", "PUT": "update", "PATCH": "patch"}


def test_the_backend_needs_nothing_the_role_does_not_grant(kube, tmp_path):
    """Every call the backend makes, as RBAC sees it, is allowed by k8s/base/rbac.yaml's Role."""
    role = next(d for d in yaml.safe_load_all((Path(__file__).parent.parent / "k8s/base/rbac.yaml").read_text())
                if d and d["kind"] == "Role")
    launcher = KubernetesLauncher(KubernetesSection(kubeconfig=str(tmp_path / "kubeconfig")))
    asyncio.run(launcher.add_worker("prefill"))
    asyncio.run(launcher.remove_worker("decode-0", "decode"))
    assert launcher.replicas("decode") == 1
    assert kube.log
    for method, path, _ in kube.log:
        parts = path.strip("/").split("/")  # api/v1/namespaces/NS/pods/NAME or apis/apps/v1/namespaces/NS/...
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[parts.index("namespaces") + 2:]
        resource, name = "/".join([rest[0], *rest[2:]]), rest[1]
        assert any(group in r["apiGroups"] and resource in r["resources"] and VERBS[method] in r["verbs"]
                   and name in r.get("resourceNames", [name]) for r in role["rules"]), (method, path)


def test_a_conflicting_write_is_retried_on_a_fresh_read(kube, tmp_path):
    launcher = KubernetesLauncher(KubernetesSection(kubeconfig=str(tmp_path / "kubeconfig")))
    kube.interfere["pdserve-decode"] = 5  # someone (`kubectl scale`, an HPA) sets 5 between our read and write
    asyncio.run(launcher.add_worker("decode"))
    assert replicas(tmp_path, "pdserve-decode") == 6, "the change lands on top of theirs, not over it"
    writes = [code for method, path, code in kube.log if method == "PUT" and path.endswith("/scale")]
    assert writes == [409, 200]


def test_kubectl_sees_the_fake_as_an_api_server(kube, tmp_path):
    """The fake is checked with the real client too: kubectl's own scale, and its precondition."""
    kubectl(tmp_path, "scale", "deployment/pdserve-prefill", "--replicas=3")
    assert replicas(tmp_path, "pdserve-prefill") == 3
    bad = subprocess.run(["kubectl", "--kubeconfig", str(tmp_path / "kubeconfig"), "scale",
                          "deployment/pdserve-prefill", "--current-replicas=1", "--replicas=4"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and replicas(tmp_path, "pdserve-prefill") == 3


def test_pdserve_scale_drives_the_deployments(kube, stories_path, tmp_path):
    """`pdserve scale` under Kubernetes: the router drains the worker it chose, marks its pod, and
    lowers the Deployment; the pod's SIGTERM (what Kubernetes then sends) ends it cleanly."""
    cluster = ProcessCluster(stories_path, tmp_path, prefill=1, decode=2,
                             **{"kubernetes.kubeconfig": str(tmp_path / "kubeconfig")})
    try:
        def scale(pool: str, n: int) -> str:
            out = subprocess.run([sys.executable, "-m", "pdserve.cli", "scale", "--router", cluster.address,
                                  "--config", str(tmp_path / "cluster.yaml"), "--pool", pool, "--replicas", str(n)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout

        assert "draining ['decode-0']" in scale("decode", 1)
        # The drain is idle-fast here; the backend then annotates and scales.
        for _ in range(100):
            if replicas(tmp_path, "pdserve-decode") == 1:
                break
            subprocess.run(["sleep", "0.1"])
        assert replicas(tmp_path, "pdserve-decode") == 1
        assert kube.annotations("decode-0").get(DELETION_COST) == "-1000000"
        assert DELETION_COST not in kube.annotations("decode-1")
        with cluster.client() as c:
            assert {w.worker_id for w in c.status().workers} == {"prefill-0", "decode-1"}
        cluster.signal("decode-0", signal.SIGTERM)
        assert cluster.procs["decode-0"].wait(30) == 0
        assert "adding ['pdserve-prefill#2']" in scale("prefill", 2)
        assert replicas(tmp_path, "pdserve-prefill") == 2
    finally:
        cluster.stop()


def test_the_planner_scales_the_deployments(kube, stories_path, tmp_path):
    """The SLA planner in a router under Kubernetes acts through the backend: a burst one prefill
    worker cannot absorb raises the prefill Deployment's replicas (the pods would then start and
    register; here the fake only records the count)."""
    import json
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pdcommon.client import make_request
    from pdcommon.step_cost import StepCostModel

    profile = tmp_path / "slow-chip.json"
    # A chip slow enough that the burst needs more than one prefill worker even at the rate the
    # planner's forecaster smooths it to: at 0.2 s per 64 tokens it held at one worker whenever
    # the 16 requests fell inside one 0.5 s interval (a fast machine, or a lucky split).
    StepCostModel([1, 64], [0.01, 0.6], 0.0, 0.0, kv_capacity_tokens=4096).save(profile)
    cluster = ProcessCluster(stories_path, tmp_path, prefill=1, decode=1,
                             **{"kubernetes.kubeconfig": str(tmp_path / "kubeconfig"), "planner.mode": "sla",
                                "planner.profile": str(profile), "planner.interval_s": 0.5,
                                "planner.ttft_slo_s": 1.0})
    kube.objects[("deployments", "pdserve-decode")]["spec"]["replicas"] = 1
    try:
        with cluster.client() as client, ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: client.generate(make_request([5 + i] * 40, max_tokens=4), timeout=60), range(16)))
            end = time.monotonic() + 30
            while replicas(tmp_path, "pdserve-prefill") == 1:
                assert time.monotonic() < end, client.status().planner
                time.sleep(0.2)
            plan = json.loads(client.status().planner)
        assert plan["acting"] is True and plan["decision"]["desired"]["prefill"] > 1
        writes = [path for method, path, code in kube.log if method == "PUT" and code == 200]
        assert any(p.endswith("/deployments/pdserve-prefill/scale") for p in writes)
    finally:
        cluster.stop()
