"""Engine outputs to the worker API's messages."""

from __future__ import annotations

from engine import RequestOutput
from pdcommon.convert import tokens_to_proto


def _out(ids, text, finish=None, tops=None):
    return RequestOutput("r", ids, [-0.5 * i for i in ids], text, finish is not None, finish, 3, 0, len(ids),
                         new_top_logprobs=tops or [None] * len(ids))


def test_outputs_a_stream_fell_behind_on_go_out_as_one_message():
    outs = [_out([5], "a", tops=[{5: -0.1}]), _out([6], "b", tops=[{6: -0.2}]), _out([7], "c", "length", [{7: -0.3}])]
    msg = tokens_to_proto(outs)
    assert list(msg.token_ids) == [5, 6, 7] and msg.text == "abc" and msg.finish_reason == "length"
    assert list(msg.logprobs) == [-2.5, -3.0, -3.5]
    tops = [{k: round(v, 6) for k, v in t.logprobs.items()} for t in msg.top_logprobs]  # float32 on the wire
    assert tops == [{5: -0.1}, {6: -0.2}, {7: -0.3}]


def test_one_output_is_one_message_and_unfinished_has_no_reason():
    msg = tokens_to_proto([_out([9], " x")], kv_transfer_bytes=10)
    assert list(msg.token_ids) == [9] and msg.text == " x" and not msg.finish_reason and not msg.top_logprobs
    assert msg.kv_transfer_bytes == 10


def test_a_resumed_attempt_asks_no_prompt_logprobs():
    """The first attempt delivered them with the first token; a retry after failover resumes
    with the client's tokens appended to the prompt, whose logprobs nobody asked for (and which
    would keep that prompt from the prefix cache)."""
    from engine import SamplingParams
    from router.request import RequestState

    st = RequestState("r", [1, 2, 3], SamplingParams(prompt_logprobs=2), deadline=0.0, arrival=0.0)
    assert st.sampling().prompt_logprobs == 2
    st.sent_ids += [7, 8]
    assert not st.sampling().HasField("prompt_logprobs") and st.sampling().max_tokens == 16
