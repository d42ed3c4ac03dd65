"""Per-request sampling parameters, validated before any compute."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses: the message names the bad field."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many most likely tokens per position
    # OpenAI's: subtracted from a token's logit once it was generated (presence) and per time it
    # was (frequency). vLLM's repetition penalty: a logit of a token in the prompt or the output
    # divided by it when positive, multiplied when not. Off at 0, 0 and 1.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: token id -> added to its logit before sampling (-100 bans, +100 forces).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's prompt_logprobs: each prompt token's logprob after the ones before it (the first has
    # none) and this many most likely tokens there; what OpenAI's echo with logprobs returns.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20):
                raise InvalidRequestError(f"{name} must be an integer in [0, 20], got {v!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r <= 2.0:
            raise InvalidRequestError(f"repetition_penalty must be a number in (0, 2], got {r!r}")
        self.logit_bias = dict(self.logit_bias)
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or isinstance(b, bool) \
                    or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                raise InvalidRequestError(f"logit_bias maps token ids to numbers in [-100, 100], got {t!r}: {b!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling starts from logits other than the model's: penalties or a bias."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)
