"""Rank 0's sampler: one row of logits adjusted (bias, penalties, grammar mask), filtered and sampled.

Every request samples with its own torch.Generator (seeded by the request, or by rank 0's RNG), so its output does
not depend on what else is in the batch. Only rank 0 ever calls these.
"""

from __future__ import annotations

import torch

from worker.sampling.params import SamplingParams, TokenLogprobs
from worker.scheduler import Sequence


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


def prepare_logits(seq: Sequence, row: torch.Tensor, path_tokens: list[int] | tuple = ()) -> torch.Tensor:
    """Rank 0's view of one row before choosing a token: logit bias, penalties, then the grammar mask, applied
    to one float32 copy (the row itself is left for logprobs).

    `path_tokens` are tokens accepted after the committed ones in a verify walk (speculative decoding)."""
    p = seq.params
    if not p.adjusts_logits and seq.grammar is None:
        return row
    row = row.float().clone()
    if p.logit_bias:
        apply_logit_bias(row, p)
    if p.has_penalties:
        apply_penalties(row, p, seq.token_ids[: seq.num_prompt], seq.output_ids + list(path_tokens))
    if seq.grammar is not None:
        seq.grammar.speculate(list(path_tokens))
        seq.grammar.mask_(row)
    return row
