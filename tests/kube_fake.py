"""A small Kubernetes API server for tests: Deployments with their scale subresource, and Pods,
in one namespace, over plain HTTP on 127.0.0.1. Enough of the real API for the `kubernetes`
Python client and a real `kubectl` (legacy discovery, get, scale, annotate): resourceVersion
on every object, 409 Conflict on a write that carries a stale one, 404 for what is not there.
Every request is logged (method, path, status) so tests can check what a client did."""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

DISCOVERY = {
    "/api": {"kind": "APIVersions", "versions": ["v1"],
             "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": "apps", "versions": [{"groupVersion": "apps/v1", "version": "v1"}],
         "preferredVersion": {"groupVersion": "apps/v1", "version": "v1"}}]},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod", "shortNames": ["po"],
         "verbs": ["get", "list", "patch", "update"]}]},
    "/apis/apps/v1": {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "apps/v1", "resources": [
        {"name": "deployments", "singularName": "deployment", "namespaced": True, "kind": "Deployment",
         "shortNames": ["deploy"], "verbs": ["get", "list", "patch", "update"]},
        {"name": "deployments/scale", "singularName": "", "namespaced": True, "group": "autoscaling",
         "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]}]},
    "/version": {"major": "1", "minor": "30", "gitVersion": "v1.30.0", "platform": "linux/amd64"},
}
PATH = re.compile(r"^/(?:api/v1|apis/apps/v1)/namespaces/(?P<ns>[^/]+)/(?P<kind>pods|deployments)"
                  r"(?:/(?P<name>[^/]+)(?:/(?P<sub>scale))?)?$")


class FakeKube:
    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.objects: dict[tuple[str, str], dict] = {}  # (kind, name) -> object
        self.version = 0
        self.log: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        self.interfere: dict[str, int] = {}  # deployment -> replicas another writer sets before our next write
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # ---- state --------------------------------------------------------------------------------
    def _meta(self, name: str, labels: dict | None = None) -> dict:
        self.version += 1
        return {"name": name, "namespace": self.namespace, "uid": str(uuid.uuid4()),
                "resourceVersion": str(self.version), "labels": labels or {}, "annotations": {}}

    def add_deployment(self, name: str, replicas: int, component: str) -> None:
        labels = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component}
        self.objects[("deployments", name)] = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": self._meta(name, labels),
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": component, "image": "pdserve"}]}}},
            "status": {"replicas": replicas}}

    def add_pod(self, name: str, component: str) -> None:
        labels = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component}
        self.objects[("pods", name)] = {"apiVersion": "v1", "kind": "Pod", "metadata": self._meta(name, labels),
                                        "spec": {"containers": [{"name": component, "image": "pdserve"}]},
                                        "status": {"phase": "Running"}}

    def replicas(self, name: str) -> int:
        return self.objects[("deployments", name)]["spec"]["replicas"]

    def annotations(self, pod: str) -> dict:
        return self.objects[("pods", pod)]["metadata"].get("annotations") or {}

    def _scale(self, dep: dict) -> dict:
        meta = dep["metadata"]
        selector = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion")},
                "spec": {"replicas": dep["spec"]["replicas"]},
                "status": {"replicas": dep["spec"]["replicas"], "selector": selector}}

    def _set_replicas(self, dep: dict, n: int) -> None:
        self.version += 1
        dep["spec"]["replicas"] = dep["status"]["replicas"] = n
        dep["metadata"]["resourceVersion"] = str(self.version)

    # ---- HTTP ---------------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if method == "GET" and path in DISCOVERY:
            return 200, DISCOVERY[path]
        m = PATH.match(path)
        if m is None or m["ns"] != self.namespace:
            return 404, _status(404, "NotFound", f"{path} not found")
        kind, name, sub = m["kind"], m["name"], m["sub"]
        if name is None:
            if method != "GET":
                return 405, _status(405, "MethodNotAllowed", method)
            items = [o for (k, _), o in self.objects.items() if k == kind]
            return 200, {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(self.version)},
                         "items": items}
        obj = self.objects.get((kind, name))
        if obj is None:
            return 404, _status(404, "NotFound", f'{kind} "{name}" not found')
        if method == "GET":
            return 200, self._scale(obj) if sub else obj
        if sub and name in self.interfere:  # another writer gets there first
            self._set_replicas(obj, self.interfere.pop(name))
        if method == "PUT":
            sent = (body or {}).get("metadata", {}).get("resourceVersion")
            if sent and sent != obj["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", "the object has been modified; please apply your changes "
                                                      "to the latest version and try again")
            if sub:
                self._set_replicas(obj, int(body["spec"]["replicas"]))
                return 200, self._scale(obj)
            return 405, _status(405, "MethodNotAllowed", "PUT on a whole object is not served here")
        if method == "PATCH":
            target = {"spec": {"replicas": obj["spec"]["replicas"]}} if sub else obj
            _merge(target, body or {})
            if sub:
                self._set_replicas(obj, int(target["spec"]["replicas"]))
                return 200, self._scale(obj)
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            return 200, obj
        return 405, _status(405, "MethodNotAllowed", method)

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                with fake.lock:
                    code, out = fake.handle(method, self.path, body)
                    fake.log.append((method, self.path.split("?", 1)[0], code))
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                self._serve("GET")

            def do_PUT(self) -> None:  # noqa: N802
                self._serve("PUT")

            def do_PATCH(self) -> None:  # noqa: N802
                self._serve("PATCH")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def log_message(self, *args) -> None:
                pass

        return Handler

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": self.namespace}}]}))
        return path

    def __enter__(self) -> FakeKube:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def _merge(target: dict, patch: dict) -> None:
    """JSON merge patch (RFC 7386), which strategic merge equals for the fields used here."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
