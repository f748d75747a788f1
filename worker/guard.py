"""Divergence guard: ranks compare a fingerprint of the state they just committed.

A rank that drifted (different batch, seq_lens or accepted counts) would otherwise hang the next
collective; one tiny all-gather turns that into a RankDivergenceError that names the step and the ranks.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from worker.dist import TPGroup
from worker.protocol import ForwardPlan, SpecPlan, StepPlan


class RankDivergenceError(RuntimeError):
    pass


def fingerprint(plan: StepPlan, committed: list[int]) -> int:
    """64-bit digest of the plan each rank ran (seq lens, input tokens; for a speculative step each sequence's
    context and draft lengths, its context candidates and whether it drafted) and of what it committed (token
    counts; for speculation the accepted path, bonus token, and the decision channel's digest and count)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", plan.step))
    if isinstance(plan, ForwardPlan):
        for ctx, q, _ in plan.seqs:
            h.update(struct.pack("<qq", ctx, q))
        h.update(struct.pack(f"<{len(plan.input_ids)}q", *plan.input_ids))
    elif isinstance(plan, SpecPlan):
        h.update(struct.pack("<q", int(plan.draft)))
        for q in plan.seqs:
            h.update(
                struct.pack(f"<qqq{len(q.context_ids)}q", q.ctx_len, q.draft_cached, len(q.extend_ids), *q.context_ids)
            )
    h.update(struct.pack(f"<{len(committed)}q", *committed))
    return struct.unpack("<q", h.digest())[0]


def check_consistency(tp: TPGroup, step: int, digest: int) -> None:
    gathered = tp.all_gather_int64(torch.tensor([step, digest], dtype=torch.int64))
    steps, digests = gathered[:, 0].tolist(), gathered[:, 1].tolist()
    if len(set(digests)) > 1 or len(set(steps)) > 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        parts = "; ".join(f"ranks {rs}" for rs in groups.values())
        raise RankDivergenceError(
            f"TP ranks diverged at step {step}: their committed state differs ({parts} agree among themselves)"
        )
