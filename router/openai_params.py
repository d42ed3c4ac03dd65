"""OpenAI request bodies -> GenerateRequest, every field checked before any work is done.

A wrong type or an out-of-range value is an ApiError(400) naming the field; a field pdserve does
not implement is refused by name rather than silently ignored, unless it carries the value that
means "off" (frequency_penalty: 0, n: 1, ...), which clients often send."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcommon.client import make_request
from pdcommon.v1 import router_pb2 as pb

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_CHOICES = 128  # prompts x n of one HTTP request: each is a request of its own in the pools
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
          "ignore_eos", "user", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias"}
FIELDS = {"completion": COMMON | {"prompt", "echo", "best_of"},
          "chat": COMMON | {"messages", "top_logprobs", "max_completion_tokens"}}
# Fields pdserve does not implement, with the values that leave them off.
OFF_VALUES = {"suffix": ("",), "parallel_tool_calls": (False,),
              "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.etype, self.param, self.code = status, message, etype, param, code
        self.headers = headers or {}


def bad(name: str, message: str) -> ApiError:
    return ApiError(400, f"'{name}' {message}", param=name, code="invalid_value")


def integer(body: dict, name: str, lo: int, hi: int, default: int | None = None, why: str = "") -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(name, f"must be an integer in [{lo}, {hi}]{why}, got {v!r}")
    return v


def number(body: dict, name: str, lo: float, hi: float, default: float | None = None,
           lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi \
            or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise bad(name, f"must be a number in {interval}, got {v!r}")
    return float(v)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {v!r}")
    return v


def text(value: object, name: str) -> str:
    """A string that is valid Unicode (a lone surrogate cannot be encoded or tokenized)."""
    if not isinstance(value, str):
        raise bad(name, f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(name, f"is not valid Unicode ({e.reason} at position {e.start})") from e
    return value


def token_ids(value: list, name: str, vocab: int) -> list[int]:
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad(name, f"token ids must be integers in [0, {vocab}), got {t!r}")
    return value


def prompts(body: dict, vocab: int) -> list[str | list[int]]:
    """A completion's prompts: a string, a list of token ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [text(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [text(p, "prompt") if isinstance(p, str) else token_ids(p, "prompt", vocab) for p in prompt]
    if isinstance(prompt, list) and all(not isinstance(p, (str, list)) for p in prompt):
        return [token_ids(prompt, "prompt", vocab)]
    raise bad("prompt", "must be a string, a list of token ids, or a list of strings or of token-id lists")


def _most_per_prompt(num_prompts: int) -> int:
    return max(MAX_CHOICES // max(num_prompts, 1), 1)


def choices(body: dict, num_prompts: int) -> int:
    """n: samples per prompt, at most MAX_CHOICES across the request's prompts."""
    n = integer(body, "n", 1, _most_per_prompt(num_prompts), 1,
                why=f" ({num_prompts} prompt(s) x n is at most {MAX_CHOICES})")
    if num_prompts > MAX_CHOICES:
        raise bad("prompt", f"may hold at most {MAX_CHOICES} prompts, got {num_prompts}")
    return n


def best_of(body: dict, n: int, num_prompts: int) -> int:
    """best_of: samples per prompt of which the n likeliest (highest summed logprob) are returned;
    not with streaming, whose choices go out before the others are known (as OpenAI has it)."""
    k = integer(body, "best_of", n, max(_most_per_prompt(num_prompts), n), n,
                why=f" (at least n; {num_prompts} prompt(s) x best_of is at most {MAX_CHOICES})")
    if k > n and body.get("stream"):
        raise bad("best_of", "cannot be used with stream")
    return k


def check_fields(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in FIELDS[kind] and name not in OFF_VALUES:
            continue
        if name in OFF_VALUES:
            if value is None or value in OFF_VALUES[name]:
                continue
            only = f"{name}={OFF_VALUES[name][0]!r}"
            raise ApiError(400, f"'{name}' is not supported by pdserve (only {only})", param=name,
                           code="unsupported_parameter")
        raise ApiError(400, f"unknown field '{name}'", param=name, code="unsupported_parameter")


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    for s in stop:
        if not text(s, "stop") or len(s) > MAX_STOP_CHARS:
            raise bad("stop", f"strings must have 1 to {MAX_STOP_CHARS} characters")
    return stop


def logit_bias(body: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias}: JSON keys are strings."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} token ids to numbers")
    out = {}
    for k, v in raw.items():
        t = int(k) if isinstance(k, str) and k.isdecimal() else -1
        if not 0 <= t < vocab or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad("logit_bias", f"maps token ids in [0, {vocab}) to numbers in [-100, 100], got {k!r}: {v!r}")
        out[t] = float(v)
    return out


@dataclass(slots=True)
class Limits:
    vocab_size: int
    max_model_len: int


def scored_only(body: dict) -> bool:
    """A completion with echo and max_tokens 0: the prompt, nothing generated."""
    return boolean(body, "echo") and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)


def stream_options(body: dict) -> bool:
    """include_usage of a valid stream_options object."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad("stream_options", "must be an object like {\"include_usage\": true}")
    return boolean(opts, "include_usage")


def generate_requests(body: dict, many: list[str | list[int]], n: int, rid: str, limits: Limits,
                      chat: bool) -> list[pb.GenerateRequest]:
    """One request per choice, in choice order (prompt x n + sample). One choice keeps the HTTP
    request's id; more are `id-k`. Sample j of a seeded body draws from seed + j: reproducible,
    and not n copies of one sample."""
    if len(many) * n == 1:
        return [generate_request(body, many[0], rid, limits, chat)]
    seed = integer(body, "seed", 0, 2**64 - 1)
    out = []
    for k in range(len(many) * n):
        j = k % n
        b = body if seed is None or j == 0 else {**body, "seed": (seed + j) % 2**64}
        out.append(generate_request(b, many[k // n], f"{rid}-{k}", limits, chat))
    return out


def generate_request(body: dict, prompt: str | list[int], rid: str, limits: Limits, chat: bool) -> pb.GenerateRequest:
    """The sampling fields of a completion or chat body, validated, as a GenerateRequest."""
    boolean(body, "stream")
    stream_options(body)
    ctx = f" (the model's context length is {limits.max_model_len})"
    max_tokens = integer(body, "max_completion_tokens", 1, limits.max_model_len, why=ctx) if chat else None
    echo = not chat and boolean(body, "echo")
    # max_tokens 0 with echo scores the prompt alone (vLLM's way): one token is generated, and
    # left out of the response (scored_only).
    max_tokens = max_tokens or integer(body, "max_tokens", 0 if echo else 1, limits.max_model_len, 16, why=ctx) or 1
    if chat:
        want = boolean(body, "logprobs")
        top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        logprobs = (top if top is not None else 1) if want else None
    else:
        logprobs = integer(body, "logprobs", 0, MAX_LOGPROBS)
    # echo with logprobs: the prompt's tokens' too, with as many alternatives.
    prompt_logprobs = logprobs if echo else None
    top_k = integer(body, "top_k", -1, limits.vocab_size)
    if top_k == 0:
        raise bad("top_k", f"must be -1 (off) or an integer in [1, {limits.vocab_size}], got 0")
    return make_request(prompt, max_tokens=max_tokens, temperature=number(body, "temperature", 0, 1e6, 1.0),
                        top_p=number(body, "top_p", 0, 1, lo_open=True), top_k=top_k,
                        seed=integer(body, "seed", 0, 2**64 - 1), stop=stop_strings(body), request_id=rid,
                        ignore_eos=boolean(body, "ignore_eos"), logprobs=logprobs,
                        presence_penalty=number(body, "presence_penalty", -2, 2),
                        frequency_penalty=number(body, "frequency_penalty", -2, 2),
                        repetition_penalty=number(body, "repetition_penalty", 0, 2, lo_open=True),
                        logit_bias=logit_bias(body, limits.vocab_size), prompt_logprobs=prompt_logprobs)
