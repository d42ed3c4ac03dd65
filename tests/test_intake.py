"""Router intake: short text prompts are tokenized on the event loop (no pool hop), long ones on
the pool, so a huge prompt never runs on the loop; both give the tokenizer's ids."""

from __future__ import annotations

import asyncio
import threading

from engine import ModelInfo
from pdcommon.v1 import router_pb2 as pb
from router.intake import INLINE_TOKENIZE_CHARS, Intake


class _Recording:
    """The model's tokenizer, noting the thread of each call."""

    def __init__(self, tok) -> None:
        self.tok, self.threads = tok, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        return self.tok(*args, **kwargs)


def test_short_prompts_tokenize_inline_and_long_ones_off_the_loop(stories_path):
    model = ModelInfo.load(stories_path)
    plain = model.tokenizer
    rec = model.tokenizer = _Recording(plain)
    intake = Intake(model, request_timeout_s=60, block_size=16)
    short = "Once upon a time there was a little girl named Lily."
    long = " ".join(["little"] * 400)  # one token a word: over the limit in characters, within the context
    assert len(short) <= INLINE_TOKENIZE_CHARS < len(long)

    async def parse(text: str):
        st = await intake.parse(pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=1)), None)
        return st.prompt, threading.current_thread()

    for text, inline in ((short, True), (long, False)):
        prompt, loop_thread = asyncio.run(parse(text))
        assert prompt == list(plain(text).input_ids)
        assert (rec.threads[-1] is loop_thread) == inline
