"""User API keys on the public API (#9, item 4): the openai client works with the right key and
gets 401 without it; gRPC gets UNAUTHENTICATED; probes are open unless asked; workers still join
(the Control service on the same port is not the public API)."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import openai
import pytest

from pdcommon.client import RouterClient, make_request
from tests.cluster_utils import InProcessCluster, make_config

KEY = "sk-pdserve-test-key"


@pytest.fixture(scope="module")
def cluster(stories_path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# one key per line\n{KEY}\n")
    with InProcessCluster(make_config(stories_path, **{"router.api_keys_file": str(keys)})) as c:
        yield c


def _get(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_openai_client_needs_the_key(cluster):
    base = cluster.core.http_address + "/v1"
    ok = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    out = ok.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5
    for wrong in ("sk-wrong", KEY[:-1]):
        bad = openai.OpenAI(base_url=base, api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=5)
        assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
    assert _get(cluster.core.http_address + "/v1/models") == 401
    assert _get(cluster.core.http_address + "/v1/models", KEY) == 200


def test_probes_are_open_by_default(cluster):
    assert _get(cluster.core.http_address + "/health") == 200
    assert _get(cluster.core.http_address + "/metrics") == 200


def test_grpc_needs_the_key(cluster):
    with RouterClient(cluster.address, api_key="sk-wrong") as c:
        with pytest.raises(grpc.RpcError) as ei:
            c.generate(make_request("Once upon a time", max_tokens=4), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            c.status()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert c.health().ready  # the probe stays open
    with RouterClient(cluster.address, api_key=KEY) as c:
        assert c.generate(make_request("Once upon a time", max_tokens=4), timeout=30).finish_reason == "length"
        assert len(c.status().workers) == 2  # the workers registered: Control is not behind the key


def test_protected_probes(stories_path):
    cfg = make_config(stories_path, **{"router.api_keys": [KEY], "router.protect_probes": True})
    with InProcessCluster(cfg) as cl:
        assert _get(cl.core.http_address + "/metrics") == 401
        assert _get(cl.core.http_address + "/metrics", KEY) == 200
        with RouterClient(cl.address) as c, pytest.raises(grpc.RpcError) as ei:
            c.health()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
