"""Sampling parameters, their validation, and the rank-0 sampler.

Every request samples with its own torch.Generator (seeded by the request, or by rank 0's RNG), so its
output does not depend on what else is in the batch. Only rank 0 ever calls the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .grammar import GrammarSpec


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's error.param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


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
        check(all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias",
              "logit_bias values must be in [-100, 100]")
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


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> None:
    """In place on one row. A bias of -100 bans the token outright (OpenAI: "should result in a ban")."""
    ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=logits.device)
    bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
    logits.index_add_(0, ids, bias)
    banned = ids[bias <= -100.0]
    if len(banned):
        logits[banned] = float("-inf")


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
    """In place on one row: repetition penalty over prompt and output (HF), presence/frequency over output (OpenAI)."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def filter_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to one row of logits; returns probabilities."""
    logits = logits / max(params.temperature, 1e-5)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop_sorted = (cum - sorted_p) > params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) drawn from the request's own generator."""
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = torch.topk(logp, k)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return TokenLogprobs(token_id, float(logp[token_id]), top)
