"""What rank 0 broadcasts for a speculative decode step (inside StepPlan.spec)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecSeq:
    ctx_len: int  # n: tokens with target KV; the root token x_n is extend_ids[-1]
    block_table: list[int]
    draft_cached: int  # positions [0, draft_cached) hold valid draft KV
    extend_ids: list[int]  # x_{t+1} for t in [draft_cached, n): the draft catches up on these positions
    context_ids: list[int] = field(default_factory=list)  # rank 0's prompt-lookup candidates (a chain)


@dataclass
class SpecStep:
    seqs: list[SpecSeq]
    draft: bool = True  # False: rank 0 judged drafting unprofitable; verify the root and context candidates only
