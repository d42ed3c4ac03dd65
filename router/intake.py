"""Request intake: size limits checked before any work, tokenizing off the event loop, sampling
parameters validated, a seed fixed for sampled requests (so a retry redraws the same tokens)."""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from engine import InvalidRequestError, ModelInfo
from engine.hashing import hash_blocks
from pdcommon.convert import params_from_proto
from pdcommon.v1 import router_pb2 as pb
from router.openai_params import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from router.request import RequestFailed, RequestState

PREFIX_BLOCKS = 64  # leading blocks tracked for prefix-aware routing
# No tokenizer we know of packs more characters into one token: longer text cannot fit the context.
MAX_CHARS_PER_TOKEN = 256
# Prompts up to this many characters are tokenized on the event loop (tens of microseconds): the
# hop to the pool thread and back cost more than that on a busy 2-core host. Longer ones go to
# the pool, so a huge prompt never stalls heartbeats or other streams.
INLINE_TOKENIZE_CHARS = 2048
# Wire bytes of one prompt position's logprob with k alternatives: about 7 for the float and its
# map, and 11 for each uint32 -> float entry; they come in the worker's one FirstToken message.
POSITION_BYTES, ALTERNATIVE_BYTES = 7, 11


class Intake:
    def __init__(self, model: ModelInfo, request_timeout_s: float, block_size: int,
                 max_message_bytes: int = 16 << 20) -> None:
        self.model, self.request_timeout_s, self.block_size = model, request_timeout_s, block_size
        self.max_message_bytes = max_message_bytes
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="router-cpu")

    async def offload(self, fn, *args):
        """Run CPU-heavy work (tokenizing, templating, detokenizing) off the event loop, so a huge
        prompt never stalls heartbeats or other streams."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def parse(self, request: pb.GenerateRequest, time_remaining: float | None) -> RequestState:
        """Validate and tokenize (raises RequestFailed with INVALID_ARGUMENT naming the problem)."""
        self._check_sizes(request)
        prompt = await self._prompt(request)
        return self._parse(request, prompt, time_remaining)

    def _check_sizes(self, request: pb.GenerateRequest) -> None:
        """Limits checked before any work: a prompt that cannot fit the context, too many stop strings."""
        limit = self.model.max_model_len * MAX_CHARS_PER_TOKEN
        if request.WhichOneof("prompt") == "text" and len(request.text) > limit:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt is {len(request.text)} characters; the model's context of "
                                f"{self.model.max_model_len} tokens cannot hold more than {limit}")
        n_ids = len(request.token_ids.ids)
        if n_ids > self.model.max_model_len:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"prompt ({n_ids} tokens) exceeds the model's "
                                                                  f"context length {self.model.max_model_len}")
        stop = request.sampling.stop
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"stop: at most {MAX_STOP_STRINGS} strings of at "
                                                                  f"most {MAX_STOP_CHARS} characters")
        bias = request.sampling.logit_bias
        if len(bias) > MAX_LOGIT_BIAS or any(t >= self.model.vocab_size for t in bias):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"logit_bias: at most {MAX_LOGIT_BIAS} token ids "
                                f"in [0, {self.model.vocab_size})")
        if request.sampling.HasField("top_k") and not (request.sampling.top_k == -1
                                                       or 1 <= request.sampling.top_k <= self.model.vocab_size):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"top_k must be -1 (off) or in "
                                f"[1, {self.model.vocab_size}], got {request.sampling.top_k}")

    def _check_prompt_logprobs(self, k: int | None, prompt_len: int) -> None:
        """Refused here, by name, when they could not fit the one message that carries them (a
        worker would fail to send it, and every retry with it)."""
        if k is None:
            return
        size = prompt_len * (POSITION_BYTES + ALTERNATIVE_BYTES * k)
        if size > self.max_message_bytes // 2:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt_logprobs: {prompt_len} prompt tokens with {k} alternatives each come to "
                                f"about {size >> 10} KiB, more than half the cluster's message limit "
                                f"(router.max_request_bytes: {self.max_message_bytes >> 10} KiB); ask for fewer")

    async def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "request has no prompt: set text or token_ids")
        if which == "text" and request.text:
            text = request.text
            prompt = self.model.encode(text) if len(text) <= INLINE_TOKENIZE_CHARS else \
                await self.offload(self.model.encode, text)
        else:
            prompt = list(request.token_ids.ids) if which == "token_ids" else []
        if not prompt:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        bad = next((t for t in prompt if t >= self.model.vocab_size), None)
        if bad is not None:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt token id {bad} is outside the vocabulary [0, {self.model.vocab_size})")
        return prompt

    def _parse(self, request: pb.GenerateRequest, prompt: list[int], time_remaining: float | None) -> RequestState:
        try:
            params = params_from_proto(request.sampling)
        except InvalidRequestError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        total = len(prompt) + params.max_tokens
        if total > self.model.max_model_len:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                                f"the model's context length {self.model.max_model_len}")
        self._check_prompt_logprobs(params.prompt_logprobs, len(prompt))
        if params.seed is None and not params.greedy:
            # Fixing the seed here makes a retried request draw the same tokens.
            params.seed = random.getrandbits(62)
        rid = request.request_id or uuid.uuid4().hex
        now = time.monotonic()
        limit = min(time_remaining if time_remaining is not None else math.inf, self.request_timeout_s)
        st = RequestState(rid, prompt, params, now + limit, now, request.slo if request.HasField("slo") else None)
        st.prefix = hash_blocks(prompt, self.block_size)[:PREFIX_BLOCKS]
        return st
