"""A worker whose engine step raises stops serving at once: its streams fail UNAVAILABLE, so the
router drops it and retries them on another worker; it does not come back through heartbeats.
Stall and heartbeat timeouts are set far beyond the client's, so only that path can finish the
request in time."""

from __future__ import annotations

import threading
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model_runner import ModelRunner
from pdcommon.client import make_request
from tests.cluster_utils import InProcessCluster, make_config

PROMPT = "Once upon a time, there was a little girl"


@pytest.fixture()
def failing_decode_step(monkeypatch):
    """Armed, the next decode-only step (a decode worker's; prefill steps carry prompt tokens)
    raises, once, in whichever worker runs it: a fault injected from the test, not a product hook."""
    armed, real = threading.Event(), ModelRunner.execute

    def execute(self, batch):
        if armed.is_set() and all(item.num_new_tokens == 1 for item in batch.scheduled):
            armed.clear()
            raise RuntimeError("injected: the device fell over")
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    return armed


def test_a_worker_whose_engine_fails_is_dropped_and_its_stream_retried(stories_path, failing_decode_step):
    greedy = dict(max_tokens=40, temperature=0.0)
    ref = LLMEngine(EngineConfig(model=stories_path)).generate([PROMPT], SamplingParams(**greedy))[0]["token_ids"]
    cfg = make_config(stories_path, **{"decode.replicas": 2, "router.stall_timeout_s": 120.0,
                                       "heartbeat.timeout_s": 120.0, "router.replace_after_s": 0.0})
    with InProcessCluster(cfg) as c, c.client() as client:
        failing_decode_step.set()
        out = []
        for msg in client.stream(make_request(PROMPT, **greedy), timeout=30):
            out += msg.token_ids
        assert not failing_decode_step.is_set(), "no decode step ran while armed"
        assert out == ref
        end = time.monotonic() + 10
        while len([w for w in client.status().workers if w.role == "decode"]) != 1:
            assert time.monotonic() < end, "the failed decode worker is still in the pool"
            time.sleep(0.1)
        time.sleep(1.0)  # heartbeats would have brought it back by now
        assert len([w for w in client.status().workers if w.role == "decode"]) == 1
        again = [t for msg in client.stream(make_request(PROMPT, **greedy), timeout=30) for t in msg.token_ids]
        assert again == ref
