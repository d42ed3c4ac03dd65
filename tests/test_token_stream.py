"""Decode tokens from the engine thread straight to the router (pdcommon/token_stream.py): only
signed messages of open streams are taken, the two channels are put back in order, and a real
cluster streams its middle tokens this way, unharmed by forged messages."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import zmq

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.client import make_request
from pdcommon.token_stream import InOrder, TokenChunk, TokenInbox, TokenPusher, pack
from tests.cluster_utils import InProcessCluster, make_config

KEY = b"k" * 16


def _send(pusher: TokenPusher, endpoint: str, frames: list[bytes]) -> bool:
    """Send once the connection is up: the pusher queues only on a live connection, so a send
    right after the socket is made can be refused (the engine then uses gRPC)."""
    end = time.monotonic() + 5
    while not pusher.send(endpoint, frames):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _chunk(index: int, ids: list[int]) -> TokenChunk:
    return TokenChunk(index, ids, "".join(f"<{t}>" for t in ids), [-0.5] * len(ids))


def test_inbox_takes_only_signed_messages_of_open_streams():
    async def run() -> tuple[list, int, int]:
        inbox = TokenInbox("127.0.0.1", 0)
        inbox.start()
        q = inbox.open("r1", 2, KEY)
        inbox.open("r2", 0, KEY)
        inbox.close_stream("r2", 0)
        endpoint = f"tcp://127.0.0.1:{inbox.port}"
        sent = []

        def engine_thread() -> None:  # the pusher lives on one thread, as on the engine's
            pusher = TokenPusher()
            msgs = [pack("r1", 2, KEY, _chunk(0, [5, 6])),
                    pack("r1", 2, b"x" * 16, _chunk(2, [9])),      # wrong key
                    pack("r1", 1, KEY, _chunk(2, [9])),             # an earlier attempt
                    pack("r2", 0, KEY, _chunk(0, [9])),             # a closed stream
                    [b"\x93garbage", b"tag"],                        # malformed
                    pack("r1", 2, KEY, _chunk(2, [7]))]
            sent.extend(_send(pusher, endpoint, m) for m in msgs)
            time.sleep(0.2)
            pusher.close()

        t = threading.Thread(target=engine_thread)
        t.start()
        got = []
        while len(got) < 2:
            got.append(await asyncio.wait_for(q.get(), 5))
        await asyncio.to_thread(t.join)
        await asyncio.sleep(0.05)
        assert all(sent)
        inbox.close()
        return got, inbox.received, inbox.refused

    got, received, refused = asyncio.run(run())
    assert [(c.index, c.token_ids, c.text) for c in got] == [(0, [5, 6], "<5><6>"), (2, [7], "<7>")]
    assert (received, refused) == (2, 4)


def test_pusher_reports_an_unreachable_router_so_the_caller_can_fall_back():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pusher = TokenPusher()
    results = [pusher.send(f"tcp://127.0.0.1:{port}", pack("r", 0, KEY, _chunk(i, [i]))) for i in range(5)]
    time.sleep(0.2)  # reconnect attempts do not make it reachable
    results.append(pusher.send(f"tcp://127.0.0.1:{port}", pack("r", 0, KEY, _chunk(5, [5]))))
    pusher.close()
    assert not any(results)


def test_a_cluster_whose_token_port_is_unreachable_streams_by_grpc(stories_path):
    """The router offers its token port, but nothing answers there (as behind a firewall): the
    worker sends every token on the gRPC stream, without waiting for a stall."""
    prompt = "Once upon a time there was a"
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        [prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]["token_ids"]
    with InProcessCluster(make_config(stories_path, **{"router.stall_timeout_s": 3.0})) as cl, cl.client() as c:
        inbox = cl.router.tokens
        cl._run(_close(inbox))  # its port no longer listens; admission still offers it
        t0 = time.monotonic()
        out = c.generate(make_request(prompt, max_tokens=60, ignore_eos=True), timeout=60)
        assert out.token_ids == ref
        assert time.monotonic() - t0 < 2.5, "tokens waited for the stall timeout instead of taking gRPC"
        assert inbox.received == 0
        cl.wait_idle()


async def _close(inbox: TokenInbox) -> None:
    inbox.close()


def test_pusher_reports_a_full_queue_so_the_caller_can_fall_back():
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.PULL)  # bound but never read, with tiny buffers: the queue fills
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 4096)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    pusher = TokenPusher(hwm=1)
    big = pack("r", 0, KEY, TokenChunk(0, list(range(1000)), "x" * 100_000, []))
    results = [_send(pusher, f"tcp://127.0.0.1:{port}", big)] + \
        [pusher.send(f"tcp://127.0.0.1:{port}", big) for _ in range(200)]
    pusher.close()
    sink.close(0)
    assert results[0] is True and False in results


def test_in_order_puts_two_channels_back_in_order():
    order = InOrder()
    assert order.push(_chunk(2, [30])) == []          # ahead of its turn
    assert order.push(_chunk(3, [40, 41])) == []
    ready = order.push(_chunk(0, [10, 20]))            # the first, late: all three follow
    assert [c.index for c in ready] == [0, 2, 3] and order.expected == 5
    assert order.push(_chunk(2, [30])) == []           # a duplicate is dropped
    last = TokenChunk(5, [50], "", [], finish_reason="stop")
    assert order.push(last) == [last] and order.waiting == 0


def test_a_cluster_streams_middle_tokens_direct_and_refuses_forged_ones(stories_path):
    prompt = "Once upon a time there was a"
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        [prompt], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))[0]["token_ids"]
    with InProcessCluster(make_config(stories_path)) as cl, cl.client() as c:
        inbox = cl.router.tokens
        assert inbox is not None, "the token port is on by default"
        got, forged = [], 0
        pusher = TokenPusher()
        for msg in c.stream(make_request(prompt, max_tokens=120, ignore_eos=True), timeout=60):
            got += msg.token_ids
            # A stranger who knows the stream's id, not its key, sends tokens ahead of the real ones.
            for st in list(cl.core.active.values()):
                forged += pusher.send(f"tcp://127.0.0.1:{inbox.port}", pack(
                    st.worker_request_id, st.attempt, b"y" * 16, _chunk(len(got) + 4, [1, 2, 3])))
        pusher.close()
        assert got == ref, "forged tokens reached the client, or direct tokens were lost or reordered"
        assert forged > 10
        deadline = time.monotonic() + 5
        while inbox.refused < forged and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inbox.refused == forged
        assert inbox.received >= 100, f"only {inbox.received} of ~118 middle tokens came direct"
        cl.wait_idle()


def test_the_first_decoded_token_comes_direct_and_the_transfer_figures_still_reach_the_client(stories_path):
    """Three tokens: the prefill worker's, the first one decoded after the KV landed, and the
    last (which ends the call). The second leaves from the decode engine thread like the middle
    ones (through the event loop it reached the router milliseconds after its step), while the
    transfer's figures go ahead on the call."""
    with InProcessCluster(make_config(stories_path)) as cl, cl.client() as c:
        inbox = cl.router.tokens
        # The pusher's connection is made on its first send (which goes by gRPC): up before measuring.
        c.generate(make_request("Once upon a time", max_tokens=8, ignore_eos=True))
        before = inbox.received
        out = c.generate(make_request("Once upon a time", max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3 and out.finish_reason == "length"
        assert inbox.received - before == 1, "the first decoded token did not come direct"
        assert out.usage["kv_transfer_bytes"] > 0 and out.timings["kv_transfer"] > 0
        cl.wait_idle()


def test_a_first_token_prefilled_where_it_decodes_comes_direct_with_its_figures(stories_path, story):
    """Colocated: the prompt's first token leaves from the engine thread too (on the event loop it
    waited behind the next step), with the prefill's figures; a first token that ends the stream
    or carries top logprobs still comes on the call. The same tokens as the engine alone."""
    prompt = story[:40]  # two full blocks: the second request hits the prefix cache
    ref = LLMEngine(EngineConfig(model=stories_path)).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]["token_ids"]
    cfg = make_config(stories_path, **{"mode": "colocated", "colocated.replicas": 1})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        inbox = cl.router.tokens
        c.generate(make_request("Once upon a time", max_tokens=8, ignore_eos=True))  # the pusher connects
        for k in range(2):
            before = inbox.received
            out = c.generate(make_request(prompt, max_tokens=3, ignore_eos=True))
            assert out.token_ids == ref and out.finish_reason == "length"
            assert inbox.received - before == 2, "the first token did not come direct (the last rides the call)"
            assert out.timings["prefill"] > 0 and out.usage["cached_tokens"] == (0 if k == 0 else 32)
        before = inbox.received
        one = c.generate(make_request(prompt, max_tokens=1))  # ends the stream: on the call
        tops = c.generate(make_request(prompt, max_tokens=3, ignore_eos=True, logprobs=2))
        assert one.token_ids == ref[:1] and one.finish_reason == "length"
        assert tops.token_ids == ref and len(tops.logprobs) == 3
        assert inbox.received == before, "a first token that ends the stream or has top logprobs came direct"
        cl.wait_idle()


def test_one_message_per_step_carries_several_streams_each_checked_on_its_own():
    async def run() -> tuple[list, list, int, int]:
        inbox = TokenInbox("127.0.0.1", 0)
        inbox.start()
        qa, qb = inbox.open("a", 0, KEY), inbox.open("b", 0, b"b" * 16)
        pusher = TokenPusher()
        # Stream b's chunk is signed with a's key: refused; a's and the second b's still land.
        step = pack("a", 0, KEY, _chunk(0, [1])) + pack("b", 0, KEY, _chunk(0, [2])) + \
            pack("b", 0, b"b" * 16, _chunk(0, [3]))
        assert _send(pusher, f"tcp://127.0.0.1:{inbox.port}", step)
        got_a = [await asyncio.wait_for(qa.get(), 5)]
        got_b = [await asyncio.wait_for(qb.get(), 5)]
        pusher.close()
        inbox.close()
        return got_a, got_b, inbox.received, inbox.refused

    got_a, got_b, received, refused = asyncio.run(run())
    assert [c.token_ids for c in got_a] == [[1]] and [c.token_ids for c in got_b] == [[3]]
    assert (received, refused) == (2, 1)
