"""The fused MoE kernels (worker/kernels/fused_moe.py) in Triton's interpreter against a float32 torch reference:
random routings, ragged expert loads with empty experts, top-k 1 to 8, float32, bfloat16 and block-FP8 weights.
Tolerances: float32 1e-4 relative (summation order only); bfloat16 and FP8 2e-2 (the intermediate is stored in the
activation dtype, as the model's own MLP stores it)."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.fused_moe import ExpertWeights, align_by_expert, fused_experts, reference_experts
from worker.model.fp8 import quantize


def test_alignment_puts_each_block_in_one_expert_and_every_row_once():
    ids = torch.tensor([[2, 0], [2, 1], [2, 2]])  # expert 2 holds four rows, expert 3 none
    blocks = align_by_expert(ids, num_experts=4, block_m=2)
    rows = blocks.row_of_slot.view(-1, 2)
    pad = ids.numel()
    assert sorted(r for r in blocks.row_of_slot.tolist() if r != pad) == list(range(pad))
    for b, e in enumerate(blocks.expert_of_block.tolist()):
        members = [r for r in rows[b].tolist() if r != pad]
        if e < 0:
            assert not members
        else:
            assert members and all(ids.view(-1)[r] == e for r in members)
    assert blocks.expert_of_block.tolist()[:3] == [0, 1, 2] and blocks.expert_of_block.tolist()[3] == 2


def _case(n, experts, k, hidden, inter, dtype, skew, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    logits = torch.randn(n, experts, generator=g)
    logits[:, : experts // 2] += skew  # ragged loads; with a skew the upper experts are mostly empty
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    return x, ids, weights, w13, w2


@pytest.mark.parametrize(
    "n,experts,k,skew", [(1, 4, 1, 0.0), (7, 8, 2, 3.0), (19, 16, 4, 0.0), (5, 8, 8, 0.0), (33, 32, 6, 4.0)]
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fused_experts_match_the_reference(n, experts, k, skew, dtype, tol, device):
    x, ids, weights, w13, w2 = _case(n, experts, k, 48, 40, dtype, skew, seed=n)
    up, down = ExpertWeights(w13), ExpertWeights(w2)
    on = ExpertWeights(w13.to(device)), ExpertWeights(w2.to(device))
    out = fused_experts(x.to(device), ids.to(device), weights.to(device), *on, block_n=16, block_k=16).cpu()
    ref = reference_experts(x, ids, weights, up, down)
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < tol, err


def test_block_fp8_experts_match_the_dequantized_reference():
    x, ids, weights, w13, w2 = _case(9, 4, 2, 256, 128, torch.bfloat16, 1.0, seed=3)

    def fp8(w):
        parts = [quantize(w[e].float(), (128, 128)) for e in range(w.shape[0])]
        return ExpertWeights(torch.stack([c for c, _ in parts]), torch.stack([s for _, s in parts]), 128)

    up, down = fp8(w13), fp8(w2)
    assert up.w.dtype == torch.float8_e4m3fn and up.scale.shape == (4, 2, 2)
    out = fused_experts(x, ids, weights, up, down, block_n=32, block_k=32)
    ref = reference_experts(x, ids, weights, up, down)
    assert (out - ref).abs().max() / ref.abs().max() < 2e-2
