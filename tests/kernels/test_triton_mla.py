"""The latent-attention Triton kernel (worker/kernels/triton_mla.py) in Triton's interpreter against a float32 torch
reference, row by row: random paged layouts with decode, extend, prefill and EAGLE tree rows (ancestor masks), head
counts that do and do not fill a head block, latent and rope widths that are not powers of two, and the published
512 + 64. Tolerance: 1e-5 absolute, 1e-4 relative (float32, summation order only)."""

from __future__ import annotations

import random

import pytest
import torch
from test_triton_attention import BS, _layout

from worker.kernels.triton_attention import paged_rows
from worker.kernels.triton_mla import triton_mla_attend
from worker.model.seq_slice import slots_of


def _reference(q_lat, q_rope, cache, seqs, scale):
    lora = q_lat.shape[-1]
    out, row = torch.empty_like(q_lat), 0
    for s in seqs:
        for i in range(s.q_len):
            if s.tree is None:
                positions = list(range(s.ctx_len + i + 1))
            else:
                nodes = [s.ctx_len + j for j, v in enumerate(s.tree.mask[i].tolist()) if v]
                positions = list(range(s.ctx_len)) + nodes
            keys = cache[slots_of(s.block_table, positions, BS), 0].float()  # [keys, lora + rope]
            q = torch.cat([q_lat[row], q_rope[row]], dim=-1)  # [heads, lora + rope]
            p = torch.softmax(q @ keys.T * scale, dim=-1)
            out[row] = p @ keys[:, :lora]
            row += 1
    return out


@pytest.mark.parametrize("heads,lora,rope", [(4, 32, 8), (20, 48, 12), (16, 512, 64)])  # the last: the published widths
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_triton_mla_kernel_matches_the_reference(heads, lora, rope, device):
    rng = random.Random(heads)
    torch.manual_seed(heads)
    seqs = _layout(rng, 200)
    n = sum(s.q_len for s in seqs)
    cache = torch.randn(200 * BS, 1, lora + rope)
    q_lat, q_rope = torch.randn(n, heads, lora), torch.randn(n, heads, rope)
    scale = (lora + rope) ** -0.5
    dev = torch.device(device)  # cuda: the compiled kernel (the GPU check); cpu: the interpreter
    out = triton_mla_attend(q_lat.to(dev), q_rope.to(dev), cache.to(dev), paged_rows(seqs, dev), BS, scale).cpu()
    ref = _reference(q_lat, q_rope, cache, seqs, scale)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()
