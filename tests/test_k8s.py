"""The Kubernetes deployment, checked offline: every overlay renders with `kubectl kustomize`
and is valid against the API schemas (strict); the pieces fit each other and pdserve's own
config and CLI; RBAC grants only what the pool backend needs; and a broken manifest is rejected.
Nothing here talks to a cluster (see k8s/README.md for what has been deployed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdcommon.config import load_config
from pdserve.cli import build_parser

K8S = Path(__file__).resolve().parent.parent / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
VERSION = "1.30.0"
POOLS = ("prefill", "decode")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay rendered from a copy of k8s/ with the operator's secret files written in."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("cluster.token", "api-keys"))
    (root / "base" / "secrets" / "cluster.token").write_text("test-token-0123456789abcdef\n")
    (root / "base" / "secrets" / "api-keys").write_text("sk-test\n")
    out = {}
    for name in ["k8s", "base", *OVERLAYS]:
        path = {"k8s": root, "base": root / "base"}.get(name, root / "overlays" / name)
        res = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        out[name] = [d for d in yaml.safe_load_all(res.stdout) if d]
    return out


def kinds(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    return {name: d["spec"]["template"]["spec"]
            for kind in ("Deployment", "Job") for name, d in kinds(docs, kind).items()}


def test_overlays_exist_and_k8s_itself_is_the_cpu_demo(rendered):
    assert {"cpu-demo", "gpu"} <= set(OVERLAYS)
    assert rendered["k8s"] == rendered["cpu-demo"]  # `kubectl apply -k k8s/` works too


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_object_is_valid_strictly(rendered, overlay):
    for doc in rendered[overlay]:
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_a_broken_manifest_is_rejected(rendered):
    dep = yaml.safe_load(yaml.safe_dump(kinds(rendered["cpu-demo"], "Deployment")["pdserve-decode"]))
    dep["spec"]["replica"] = dep["spec"].pop("replicas")  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSION, strict=True)
    dep = yaml.safe_load(yaml.safe_dump(kinds(rendered["cpu-demo"], "Deployment")["pdserve-decode"]))
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"  # wrong type
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSION, strict=True)


def test_role_grants_only_scaling_the_two_pools(rendered):
    for overlay in ["base", *OVERLAYS]:
        docs = rendered[overlay]
        deployments = kinds(docs, "Deployment")
        (role,) = kinds(docs, "Role").values()
        assert not kinds(docs, "ClusterRole") and not kinds(docs, "ClusterRoleBinding")
        granted = set()
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames", ["*"]):
                            granted.add((group, res, verb, name))
        scale = {("apps", "deployments/scale", v, f"pdserve-{p}") for v in ("get", "update", "patch") for p in POOLS}
        assert granted == scale | {("", "pods", "patch", "*")}, granted
        assert all(f"pdserve-{p}" in deployments for p in POOLS)
        # Bound to the router's account alone; the workers' account cannot call the API at all.
        (binding,) = kinds(docs, "RoleBinding").values()
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert [s["name"] for s in binding["subjects"]] == ["pdserve-router"]
        specs = pod_specs(docs)
        assert specs["pdserve-router"]["serviceAccountName"] == "pdserve-router"
        for p in POOLS:
            assert specs[f"pdserve-{p}"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_non_root_with_probes_limits_and_a_drain(rendered, overlay, tmp_path, monkeypatch):
    docs = rendered[overlay]
    cfg = config_of(docs, tmp_path, monkeypatch)
    for name, spec in pod_specs(docs).items():
        pod_sec = spec["securityContext"]
        assert pod_sec["runAsNonRoot"] is True and pod_sec["runAsUser"] > 0, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            sec = c["securityContext"]
            assert sec["allowPrivilegeEscalation"] is False and sec["readOnlyRootFilesystem"] is True, name
            assert sec["capabilities"]["drop"] == ["ALL"], name
            assert c["imagePullPolicy"] == "IfNotPresent", name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
    specs = pod_specs(docs)
    for p in POOLS:
        spec = specs[f"pdserve-{p}"]
        c = spec["containers"][0]
        assert "livenessProbe" in c and "startupProbe" in c
        # Ready means registered with the router: the file the worker keeps while it is.
        assert c["readinessProbe"]["exec"]["command"] == ["test", "-f", cfg.process.ready_file]
        assert spec["terminationGracePeriodSeconds"] > cfg.process.drain_timeout_s + 5
    router = specs["pdserve-router"]["containers"][0]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health" and "livenessProbe" in router
    pdbs = kinds(docs, "PodDisruptionBudget")
    deps = kinds(docs, "Deployment")
    for p in POOLS:
        labels = deps[f"pdserve-{p}"]["spec"]["template"]["metadata"]["labels"]
        (pdb,) = [b for b in pdbs.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert pdb["spec"]["maxUnavailable"] == 1


def config_of(docs: list[dict], tmp_path: Path, monkeypatch):
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    (cm,) = kinds(docs, "ConfigMap").values()
    path = tmp_path / "cluster.yaml"
    path.write_text(cm["data"]["cluster.yaml"])
    return load_config(path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_fit_together(rendered, overlay, tmp_path, monkeypatch):
    docs = rendered[overlay]
    cfg = config_of(docs, tmp_path, monkeypatch)
    deps, services = kinds(docs, "Deployment"), kinds(docs, "Service")
    assert set(deps) == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    router = deps["pdserve-router"]["spec"]
    assert router["replicas"] == 1 and router["strategy"]["type"] == "Recreate"  # one router, never two
    assert cfg.router.advertise_host == "10.0.0.7"
    # The router scales the Deployments the config names.
    assert cfg.kubernetes is not None and all(cfg.kubernetes.deployments[p] in deps for p in POOLS)
    public, control = services["pdserve-router"], services["pdserve-router-control"]
    labels = deps["pdserve-router"]["spec"]["template"]["metadata"]["labels"]
    assert public["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in public["spec"]["ports"]} == {cfg.router.port, cfg.router.http_port}
    # Workers reach the router's token port at the host they registered with: the same Service.
    assert [p["port"] for p in control["spec"]["ports"]] == [cfg.router.control_port, cfg.router.token_port]
    # Workers register through it before the router is ready (ready = it has workers).
    assert control["spec"]["publishNotReadyAddresses"] is True
    secret = next(iter(kinds(docs, "Secret")))
    cm = next(iter(kinds(docs, "ConfigMap")))
    for dep in deps.values():
        spec = dep["spec"]["template"]["spec"]
        c = spec["containers"][0]
        role = c["command"][1]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["config"]["configMap"]["name"] == cm
        assert vols["models"]["persistentVolumeClaim"]["readOnly"] is True
        assert cfg.model.startswith("/models/")
        ports = {p["containerPort"] for p in c["ports"]}
        assert (cfg.router.port if role == "router" else cfg.pool(role).port) in ports
        if role == "decode":
            assert cfg.decode.transfer_port in ports
        if role == "router":
            assert {cfg.router.port, cfg.router.http_port, cfg.router.control_port, cfg.router.token_port} <= ports
        else:  # workers use the internal control Service, not the public one, and name themselves by pod
            control_service = f"pdserve-router-control:{cfg.router.control_port}"
            assert c["command"][c["command"].index("--router") + 1] == control_service
            assert c["command"][c["command"].index("--worker-id") + 1] == "$(WORKER_NAME)"
            env = {e["name"]: e for e in c["env"]}
            assert env["WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        # Every component mounts the cluster secret where the config expects it.
        assert vols["cluster-secret"]["secret"]["secretName"] == secret
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "cluster-secret")
        assert cfg.security.mode == "token" and cfg.security.token_file.startswith(mount + "/")
        assert cfg.router.api_keys_file.startswith(mount + "/")
        # The command line parses with pdserve's own CLI (unknown flags would exit).
        args = build_parser().parse_args([a.replace("$(WORKER_NAME)", "pod-1") for a in c["command"][1:]])
        assert args.config == "/etc/pdserve/cluster.yaml"
    # The model loader is the one pod that writes the volume.
    loader = pod_specs(docs)["pdserve-model-loader"]
    assert not loader["containers"][0]["volumeMounts"][0].get("readOnly")


def test_internal_ports_admit_only_pdserve_pods(rendered):
    docs = rendered["cpu-demo"]
    pols = kinds(docs, "NetworkPolicy")
    router = pols["pdserve-router"]["spec"]["ingress"]
    public = [r for r in router if "from" not in r]
    assert [{p["port"] for p in r["ports"]} for r in public] == [{"grpc", "http"}]
    (internal,) = [r for r in router if "from" in r]
    assert internal["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve"}}}]
    assert {p["port"] for p in internal["ports"]} == {"control", "tokens"}
    workers = pols["pdserve-workers-internal"]["spec"]
    assert all("from" in r for r in workers["ingress"])


def test_gpu_overlay_puts_pools_on_their_node_types(rendered):
    specs = pod_specs(rendered["gpu"])
    for p in POOLS:
        spec = specs[f"pdserve-{p}"]
        assert spec["nodeSelector"] == {"pdserve.io/pool": p}
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
