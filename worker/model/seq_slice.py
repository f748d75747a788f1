"""What one sequence contributes to a step: its new rows after its cached ones, its block table, and for an EAGLE
tree the keys each node may see. The model, the attention backends and graph capture all read this one type."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeKeys:
    """Non-causal keys for EAGLE trees: new tokens go to `write_slots`, each sees the whole context plus the
    `key_slots` its row of `mask` allows (its ancestors and itself)."""

    write_slots: list[int]
    key_slots: list[int]
    mask: torch.Tensor  # [q_len, len(key_slots)] bool


@dataclass
class SeqSlice:
    """One sequence's part of a step: q_len new tokens after ctx_len cached ones."""

    ctx_len: int
    q_len: int
    block_table: list[int]
    tree: TreeKeys | None = None


def slots_of(block_table: list[int], positions, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
