"""A request's sampling parameters and output constraint, and their validation.

Every request samples with its own torch.Generator (seeded by the request, or by rank 0's RNG), so its
output does not depend on what else is in the batch. Only rank 0 ever calls the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's error.param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


KINDS = ("json_object", "json_schema", "regex", "ebnf")


class InvalidGrammarError(InvalidParameterError):
    """A schema, regex or grammar that cannot be compiled; `param` names the request field (a 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What constrains one request's output: `kind` in KINDS and its source (schema JSON, regex or EBNF)."""

    kind: str
    source: str = ""
    param: str = "response_format"  # the request field it came from, for error messages


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus k alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: added to the logits; -100 bans, as OpenAI documents
    grammar: GrammarSpec | None = None  # constrained decoding (rank 0 only)
    # rank 0 finishes the request (finish_reason "timeout") once it has been this many seconds at rank 0; None: never
    timeout_s: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        return self.has_penalties or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise InvalidParameterError(param, msg)

        def finite(name: str, v: float) -> None:
            check(isinstance(v, (int, float)) and math.isfinite(v), name, f"{name} must be a finite number, got {v!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
        check(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            "max_tokens",
            f"max_tokens must be a positive integer, got {self.max_new_tokens!r}",
        )
        check(
            self.timeout_s is None or (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0),
            "timeout",
            f"a request timeout must be a positive number of seconds, got {self.timeout_s!r}",
        )
        check(0.0 <= self.temperature <= 2.0, "temperature", f"temperature must be in [0, 2], got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            f"top_k must be -1 (off) or >= 0, got {self.top_k}",
        )
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            f"seed must be a non-negative 64-bit integer, got {self.seed!r}",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "top_logprobs",
            f"top_logprobs must be in [0, 20], got {self.logprobs!r}",
        )
        check(
            all(-100.0 <= b <= 100.0 for _, b in self.logit_bias),
            "logit_bias",
            "logit_bias values must be in [-100, 100]",
        )
        check(len(self.logit_bias) <= 1024, "logit_bias", "logit_bias may name at most 1024 tokens")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
            check(not bad, "stop_token_ids", f"stop_token_ids out of vocabulary range [0, {vocab_size}): {bad}")
            bad = [t for t, _ in self.logit_bias if not (isinstance(t, int) and 0 <= t < vocab_size)]
            check(not bad, "logit_bias", f"logit_bias token ids out of vocabulary range [0, {vocab_size}): {bad}")
        return self


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
