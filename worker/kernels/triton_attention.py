"""Paged attention in Triton for GPUs (NVIDIA and ROCm): decode, chunked prefill and EAGLE tree verification in one
kernel that reads K/V straight from the block table, one program per (query row, KV head) with an online softmax.
Each row's result depends only on its own keys. Tested on CPU under TRITON_INTERPRET=1 against the reference path
(worker/model/attention.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from worker.model.seq_slice import SeqSlice

MAX_TREE_NODES = 63  # a tree row's visible nodes travel as one int64 bitmask


@dataclass
class PagedRows:
    """Per query row: its sequence, its causal key limit, and for tree rows the tree's start, size and mask."""

    seq: torch.Tensor  # [N] int32: index into block_tables
    limit: torch.Tensor  # [N] int32: keys at positions < limit are visible (tree rows: the context length)
    tree_len: torch.Tensor  # [N] int32: tree nodes after the context (0: not a tree row)
    tree_mask: torch.Tensor  # [N] int64: bit j set when tree node j is visible to this row
    block_tables: torch.Tensor  # [B, max_blocks] int32

    def kernel_args(self) -> tuple:
        """The six arguments the paged kernels (this file's and triton_mla.py's) take for the rows, in order."""
        return self.seq, self.limit, self.tree_len, self.tree_mask, self.block_tables, self.block_tables.stride(0)


def row_records(seqs: list[SeqSlice]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Each query row's (sequence, causal limit, tree size, ancestor bitmask), in row order. Tree nodes sit at
    consecutive positions after the context; a tree row sees the context and the nodes its bitmask names."""
    # e.g. 10 cached tokens, verify tree root r (node 0, position 10), its children a (1) and b (2), a's child c (3):
    # c's row has limit 10, tree size 4 and mask 0b1011 (r, a, c), so it reads positions 0-9, 10, 11 and 13
    seq, limit, tree_len, tree_mask = [], [], [], []
    for b, s in enumerate(seqs):
        for i in range(s.q_len):
            seq.append(b)
            if s.tree is None:
                limit.append(s.ctx_len + i + 1)
                tree_len.append(0)
                tree_mask.append(0)
            else:
                row = s.tree.mask[i].tolist()
                assert len(row) <= MAX_TREE_NODES, "tree masks travel as one int64 bitmask per row"
                limit.append(s.ctx_len)
                tree_len.append(len(row))
                tree_mask.append(sum(1 << j for j, v in enumerate(row) if v))
    return seq, limit, tree_len, tree_mask


def paged_rows(seqs: list[SeqSlice], device: torch.device) -> PagedRows:
    seq, limit, tree_len, tree_mask = row_records(seqs)
    width = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for b, s in enumerate(seqs):
        tables[b, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    i32 = {"dtype": torch.int32, "device": device}
    return PagedRows(
        torch.tensor(seq, **i32),
        torch.tensor(limit, **i32),
        torch.tensor(tree_len, **i32),
        torch.tensor(tree_mask, dtype=torch.int64, device=device),
        tables.to(device),
    )


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention(
        q_ptr,
        k_ptr,
        v_ptr,
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
        HKV: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(seq_ptr + row)
        limit = tl.load(limit_ptr + row)
        tree_len = tl.load(tree_len_ptr + row)
        tree_mask = tl.load(tree_mask_ptr + row)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kvh * G + g
        q = tl.load(q_ptr + (row * H + heads)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        denom = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        total = limit + tree_len
        for start in range(0, total, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            in_range = pos < total
            block = tl.load(table_ptr + seq * table_stride + pos // block_size, mask=in_range, other=0)
            slot = block * block_size + pos % block_size
            node = pos - limit
            bit = (tree_mask >> tl.maximum(node, 0).to(tl.int64)) & 1
            visible = in_range & ((pos < limit) | ((node >= 0) & (bit == 1)))
            k = tl.load(k_ptr + (slot * HKV + kvh)[:, None] * D + d[None, :], mask=visible[:, None], other=0.0)
            v = tl.load(v_ptr + (slot * HKV + kvh)[:, None] * D + d[None, :], mask=visible[:, None], other=0.0)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BLOCK_N]
            s = tl.where(visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(o_ptr + (row * H + heads)[:, None] * D + d[None, :], out, mask=(g < G)[:, None])

    return paged_attention


def triton_attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: PagedRows,
    block_size: int,
    scale: float,
    block_n: int = 32,
) -> torch.Tensor:
    """q: [N, H, D] (keys already written to the cache); returns [N, H, D] in float32."""
    n, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    out = torch.empty(n, h, d, dtype=torch.float32, device=q.device)
    _kernel()[(n, hkv)](
        q.float().contiguous(),
        k_cache.contiguous(),
        v_cache.contiguous(),
        out,
        *rows.kernel_args(),
        scale,
        block_size,
        H=h,
        HKV=hkv,
        G=g,
        GP=max(2, 1 << (g - 1).bit_length()),
        D=d,
        BLOCK_N=block_n,
    )
    return out
