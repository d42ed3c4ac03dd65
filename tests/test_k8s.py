"""The Kubernetes manifests: valid against the API schemas (offline), and consistent with
each other and with pdserve's own CLI and config."""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdcommon.config import load_config
from pdserve.cli import build_parser

K8S = Path(__file__).resolve().parent.parent / "k8s"
VERSION = "1.30.0"


def docs() -> list[dict]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


@pytest.mark.parametrize("doc", docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid(doc):
    kubernetes_validate.validate(doc, VERSION, strict=True)


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


def test_manifests_fit_together(tmp_path, monkeypatch):
    deps, services, cms, pvcs = by_kind("Deployment"), by_kind("Service"), by_kind("ConfigMap"), \
        by_kind("PersistentVolumeClaim")
    assert set(deps) == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    # Secrets are made by the operator, never committed (k8s/README.md).
    assert not by_kind("Secret")
    router_labels = deps["pdserve-router"]["spec"]["template"]["metadata"]["labels"]
    svc = services["pdserve-router"]
    assert all(router_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    # The ConfigMap's cluster.yaml is a valid pdserve config once the pod IP is known.
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    cfg_file = tmp_path / "cluster.yaml"
    cfg_file.write_text(cms["pdserve-config"]["data"]["cluster.yaml"])
    cfg = load_config(cfg_file)
    assert cfg.router.advertise_host == "10.0.0.7" and cfg.decode.transfer_port == 50071
    svc_port = svc["spec"]["ports"][0]["port"]
    assert svc_port == cfg.router.port
    # The public Service does not carry the control port; the control Service carries only it.
    assert cfg.router.control_port not in {p["port"] for p in svc["spec"]["ports"]}
    control = services["pdserve-router-control"]
    assert [p["port"] for p in control["spec"]["ports"]] == [control_port := cfg.router.control_port]
    for dep in deps.values():
        spec = dep["spec"]["template"]["spec"]
        c = spec["containers"][0]
        role = c["command"][1]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["config"]["configMap"]["name"] == "pdserve-config"
        assert vols["models"]["persistentVolumeClaim"]["claimName"] in pvcs
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/etc/pdserve" in mounts and cfg.model.startswith("/models")
        ports = {p["containerPort"] for p in c["ports"]}
        assert (cfg.router.port if role == "router" else cfg.pool(role).port) in ports
        if role == "decode":
            assert cfg.decode.transfer_port in ports
        if role != "router":  # workers use the internal control Service, not the public one
            assert c["command"][c["command"].index("--router") + 1] == f"pdserve-router-control:{control_port}"
        else:
            assert {cfg.router.port, cfg.router.http_port, cfg.router.control_port} <= ports
        # Every component mounts the cluster secret where the config expects it.
        assert vols["cluster-secret"]["secret"]["secretName"] == "pdserve-cluster"
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "cluster-secret")
        assert cfg.security.mode == "token" and cfg.security.token_file.startswith(mount + "/")
        # The command line parses with pdserve's own CLI (unknown flags would exit).
        args = build_parser().parse_args([a.replace("$(WORKER_NAME)", "pod-1") for a in c["command"][1:]])
        assert args.config == "/etc/pdserve/cluster.yaml"
    assert os.environ["POD_IP"] == "10.0.0.7"
