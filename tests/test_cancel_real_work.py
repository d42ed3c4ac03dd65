"""Cancellation and deadlines free both workers long before the request would finish on its
own. Decode is slowed by real work (the 50M benchmark model, long outputs), not a hook; each
test first measures the stream's rate and checks the request would need at least 20 s."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import grpc
import pytest

from bench.model_factory import build_bench_model, random_prompt
from pdcommon.client import RouterClient, make_request
from tests.cluster_utils import InProcessCluster, make_config

MAX_TOKENS = 3000
NEEDS_S = 20.0
FREED_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def cluster():
    path = build_bench_model()
    cfg = make_config(str(path), **{"engine.max_model_len": 4096, "router.request_timeout_s": 600})
    with InProcessCluster(cfg) as c:
        yield c


def _busy(client: RouterClient) -> dict[str, tuple[int, int]]:
    """Workers still holding blocks or running sequences, as their heartbeats report."""
    return {w.worker_id: (w.used_blocks, w.num_running) for w in client.status().workers
            if w.used_blocks or w.num_running}


def _wait_freed(client: RouterClient, since: float) -> float:
    """Seconds from `since` until every worker reports nothing held (fails past the bound)."""
    while _busy(client):
        assert time.monotonic() - since < FREED_WITHIN_S, f"still held {time.monotonic() - since:.1f}s " \
                                                           f"after the cancel: {_busy(client)}"
        time.sleep(0.05)
    return time.monotonic() - since


def _check_long(tokens: int, elapsed: float) -> None:
    rate = tokens / elapsed
    assert (MAX_TOKENS - tokens) / rate >= NEEDS_S, f"only {rate:.0f} tok/s: the request is not long enough"


def test_grpc_cancel_frees_within_two_seconds(cluster):
    with cluster.client() as c:
        stream = c.stream(make_request(random_prompt(32, 1), max_tokens=MAX_TOKENS, ignore_eos=True))
        next(stream)
        t0, n = time.monotonic(), 0
        while time.monotonic() - t0 < 1.0:
            n += len(next(stream).token_ids)
        _check_long(n, time.monotonic() - t0)
        assert _busy(c), "the request should hold blocks while it streams"
        t_cancel = time.monotonic()
        stream.cancel()
        _wait_freed(c, t_cancel)


def test_deadline_frees_within_two_seconds(cluster):
    with cluster.client() as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            c.generate(make_request(random_prompt(32, 2), max_tokens=MAX_TOKENS, ignore_eos=True), timeout=3.0)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 3.0 + FREED_WITHIN_S
        _wait_freed(c, t0 + 3.0)


def test_http_stream_disconnect_frees_within_two_seconds(cluster):
    url = urllib.parse.urlparse(cluster.core.http_address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = {"prompt": random_prompt(32, 3), "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # the first event
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < 1.0:
        line = resp.readline()
        n += line.startswith(b"data: {")
    _check_long(n, time.monotonic() - t0)
    t_close = time.monotonic()
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    with cluster.client() as c:
        _wait_freed(c, t_close)


def test_http_non_streaming_disconnect_frees_within_two_seconds(cluster):
    url = urllib.parse.urlparse(cluster.core.http_address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = {"prompt": random_prompt(32, 4), "max_tokens": MAX_TOKENS, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    with cluster.client() as c:
        end = time.monotonic() + 10
        while not _busy(c):  # until the request is decoding
            assert time.monotonic() < end
            time.sleep(0.05)
        time.sleep(0.5)
        t_close = time.monotonic()
        conn.sock.close()
        conn.close()
        _wait_freed(c, t_close)


@pytest.mark.parametrize("stream", [True, False])
def test_http_disconnect_frees_every_choice(cluster, stream):
    """n samples run as n requests side by side: a client that goes away stops all of them, not
    only the one being written when the write fails."""
    url = urllib.parse.urlparse(cluster.core.http_address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = {"prompt": random_prompt(32, 5 + stream), "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 3,
            "temperature": 1.0, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    with cluster.client() as c:
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200
            resp.readline()
            t0, n = time.monotonic(), 0
            while time.monotonic() - t0 < 1.0:
                n += resp.readline().startswith(b"data: {")
            _check_long(n / 3, time.monotonic() - t0)
        else:
            end = time.monotonic() + 10
            while not _busy(c):
                assert time.monotonic() < end
                time.sleep(0.05)
            time.sleep(0.5)
        assert sum(running for _, running in _busy(c).values()) == 3, _busy(c)
        t_close = time.monotonic()
        conn.sock.close()
        conn.close()
        _wait_freed(c, t_close)
