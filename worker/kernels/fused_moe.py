"""Fused mixture-of-experts in Triton: every expert of a layer in two grouped GEMMs, with no host sync.

The routed rows (token t's j-th choice is row t*k + j) are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M, so a block of rows belongs to one expert (the layout of SGLang's and vLLM's
`moe_align_block_size`, built here from torch ops whose shapes depend only on n, k and the expert count, so the step
can be captured in a graph):

    ids = [[2, 0], [2, 1]]   (2 tokens, k = 2, 3 experts, BLOCK_M = 2)
    rows by expert: expert 0: [1]   expert 1: [3]   expert 2: [0, 2]
    row_of_slot  = [1, P, 3, P, 0, 2, P, P]   (P = 4 = n*k: padding, skipped by the kernels)
    expert_of_block = [0, 1, 2, -1]          (-1: past the last used block; its programs return at once)

Kernel 1 multiplies each block's tokens by its expert's gate and up columns and writes silu(gate) * up; kernel 2
multiplies that by the expert's down projection and the row's routing weight. The k rows of a token are then summed.
Weights are [experts, out, in] in the model dtype, or block-FP8 codes with their [experts, out/128, in/128] scales
(dequantized per tile, float32 accumulation). Under tensor parallelism each rank holds a slice of the intermediate
size and its partial sums join the layer's one all-reduce. Tested in TRITON_INTERPRET=1 against the torch reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK_M = 16


@dataclass(frozen=True)
class ExpertBlocks:
    """Routed rows in expert order, padded per expert to whole blocks of `block_m`."""

    row_of_slot: torch.Tensor  # [capacity] int64: the routed row in each slot (n*k: padding)
    expert_of_block: torch.Tensor  # [capacity / block_m] int32: the expert of each block (-1: unused)
    block_m: int


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> ExpertBlocks:
    """ids [n, k] -> the block layout above, with shapes fixed by (n, k, experts): no value reaches the host."""
    flat = ids.reshape(-1).long()
    rows, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, in row order within an expert
    expert = flat[order]
    rank_in_expert = torch.arange(rows, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    capacity = -(-(rows + num_experts * (block_m - 1)) // block_m) * block_m
    row_of_slot = torch.full((capacity,), rows, dtype=torch.int64, device=dev)
    row_of_slot[(ends - padded)[expert] + rank_in_expert] = order
    block_start = torch.arange(0, capacity, block_m, device=dev)
    owner = torch.searchsorted(ends, block_start, right=True)
    expert_of_block = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return ExpertBlocks(row_of_slot, expert_of_block, block_m)


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's experts stacked: w [experts, out, in] (model dtype or float8 codes) and, for block-FP8, the
    scales [experts, ceil(out/block), ceil(in/block)]."""

    w: torch.Tensor
    scale: torch.Tensor | None = None
    block: int = 128

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(weights, scales, the kernels' scale constants); without scales any tensor stands in, never read."""
        if self.scale is None:
            return self.w, self.w, {"S_N": 1, "S_K": 1, "BLOCK": self.block, "FP8": False}
        meta = {"S_N": self.scale.shape[1], "S_K": self.scale.shape[2], "BLOCK": self.block, "FP8": True}
        return self.w, self.scale, meta


@functools.cache
def _kernels():
    from worker.kernels import fused_moe_triton  # imports Triton: only where the fused path runs

    return fused_moe_triton.gate_up_silu, fused_moe_triton.down_weighted


def fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    block_n: int = 64,
    block_k: int = 32,
) -> torch.Tensor:
    """x [n, hidden], ids and weights [n, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x) as float32 [n, hidden]:
    this rank's partial sums (its slice of every expert's intermediate size)."""
    n, hidden = x.shape
    k = ids.shape[1]
    experts, inter = gate_up.w.shape[0], gate_up.w.shape[1] // 2
    blocks = align_by_expert(ids, experts)
    rows = n * k
    grid_m = blocks.expert_of_block.numel()
    gate_up_silu, down_weighted = _kernels()
    tiles = {"BLOCK_M": blocks.block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    layout = (blocks.row_of_slot, blocks.expert_of_block, rows)
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    w1, s1, meta1 = gate_up.kernel_args()
    gate_up_silu[(grid_m, -(-inter // block_n))](
        x.contiguous(), w1, s1, h, *layout, TOP_K=k, H=hidden, INTER=inter, **meta1, **tiles
    )
    out = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)
    w2, s2, meta2 = down.kernel_args()
    route = weights.reshape(-1).float().contiguous()
    down_weighted[(grid_m, -(-hidden // block_n))](
        h, w2, s2, route, out, *layout, HIDDEN=hidden, INTER=inter, **meta2, **tiles
    )
    return out.view(n, k, hidden).sum(dim=1)


def reference_experts(x, ids, weights, gate_up: ExpertWeights, down: ExpertWeights) -> torch.Tensor:
    """The same sum in plain torch, float32, one expert at a time (the test's reference)."""

    def dense(w: ExpertWeights, e: int) -> torch.Tensor:
        if w.scale is None:
            return w.w[e].float()
        s = w.scale[e].repeat_interleave(w.block, 0).repeat_interleave(w.block, 1)
        return w.w[e].float() * s[: w.w.shape[1], : w.w.shape[2]]

    inter = gate_up.w.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = dense(gate_up, e) @ x[t].float()
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += weights[t, j].float() * (dense(down, e) @ h.to(x.dtype).float())
    return out
