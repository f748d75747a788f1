"""Latent attention in Triton over the paged cache of latents (worker/model/mla.py), absorbed form: every query row
(decode, verify-tree node, or prefill) against its own keys, read as one shared head of [latent ; rope key].

Per row and head h, with the query already absorbed (q_lat = W_UK_h^T q_nope_h, q_rope rotated):

    score_j = scale * (q_lat . c_j + q_rope . k_rope_j)      out = sum_j softmax(score)_j c_j   ([kv_lora])

and the caller applies W_UV_h. One program per (row, block of 16 heads): two dot products per block of keys
(scores, then the weighted latents) and an online softmax over the row's visible keys (its context, and for tree rows
the tree nodes its ancestor bitmask names, as worker/kernels/triton_attention.py reads them). No value reaches the
host, so the step can be captured. Tested under TRITON_INTERPRET=1 against a float32 reference.
"""

from __future__ import annotations

import functools

import torch

from worker.kernels.triton_attention import PagedRows


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def mla_paged_attention(
        q_lat_ptr,
        q_rope_ptr,
        cache_ptr,
        o_ptr,
        seq_ptr,
        limit_ptr,
        tree_len_ptr,
        tree_mask_ptr,
        table_ptr,
        table_stride,
        scale,
        block_size,
        H: tl.constexpr,
        L: tl.constexpr,
        LP: tl.constexpr,
        R: tl.constexpr,
        RP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = heads < H
        seq = tl.load(seq_ptr + row)
        limit = tl.load(limit_ptr + row)
        tree_len = tl.load(tree_len_ptr + row)
        tree_mask = tl.load(tree_mask_ptr + row)
        c = tl.arange(0, LP)
        r = tl.arange(0, RP)
        cm, rm = c < L, r < R
        q1 = tl.load(q_lat_ptr + (row * H + heads)[:, None] * L + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
        q2 = tl.load(
            q_rope_ptr + (row * H + heads)[:, None] * R + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0
        )
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, LP], tl.float32)
        total = limit + tree_len
        for start in range(0, total, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            in_range = pos < total
            block = tl.load(table_ptr + seq * table_stride + pos // block_size, mask=in_range, other=0)
            slot = (block * block_size + pos % block_size).to(tl.int64)
            node = pos - limit
            bit = (tree_mask >> tl.maximum(node, 0).to(tl.int64)) & 1
            visible = in_range & ((pos < limit) | ((node >= 0) & (bit == 1)))
            lat = tl.load(
                cache_ptr + slot[:, None] * (L + R) + c[None, :], mask=visible[:, None] & cm[None, :], other=0.0
            )
            kr = tl.load(
                cache_ptr + slot[:, None] * (L + R) + L + r[None, :], mask=visible[:, None] & rm[None, :], other=0.0
            )
            lat, kr = lat.to(tl.float32), kr.to(tl.float32)
            s = tl.dot(q1, tl.trans(lat), input_precision="ieee") + tl.dot(q2, tl.trans(kr), input_precision="ieee")
            s = tl.where(visible[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
            m = m_new
        out = acc / denom[:, None]
        tl.store(o_ptr + (row * H + heads)[:, None] * L + c[None, :], out, mask=hm[:, None] & cm[None, :])

    return mla_paged_attention


def _pow2(n: int) -> int:
    """Block widths: powers of two, at least 16 (tl.dot's smallest)."""
    return max(16, 1 << (n - 1).bit_length())


def triton_mla_attend(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    rows: PagedRows,
    block_size: int,
    scale: float,
    block_h: int = 16,
    block_n: int = 16,
) -> torch.Tensor:
    """q_lat [N, H, kv_lora], q_rope [N, H, rope] (rotated); cache [slots, 1, kv_lora + rope] with this step's
    latents already written. Returns the attended latents [N, H, kv_lora] in float32."""
    n, h, lora = q_lat.shape
    rope = q_rope.shape[-1]
    assert cache.shape[-1] == lora + rope, "the cache holds [latent ; rope key] per token"
    out = torch.empty(n, h, lora, dtype=torch.float32, device=q_lat.device)
    bh = block_h  # heads past H are masked: tl.dot needs 16 rows
    _kernel()[(n, -(-h // bh))](
        q_lat.float().contiguous(),
        q_rope.float().contiguous(),
        cache.contiguous(),
        out,
        *rows.kernel_args(),
        scale,
        block_size,
        H=h,
        L=lora,
        LP=_pow2(lora),
        R=rope,
        RP=_pow2(rope),
        BLOCK_H=bh,
        BLOCK_N=block_n,
    )
    return out
