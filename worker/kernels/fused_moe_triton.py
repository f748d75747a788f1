"""The Triton kernels of worker/kernels/fused_moe.py (the layout and the wrappers are there)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_rows(row_of_slot_ptr, expert_of_block_ptr, ROWS, BLOCK_M: tl.constexpr):
    """This program's block: its expert (-1: unused), its routed rows, and which of them are real (not padding)."""
    pid_m = tl.program_id(0)
    e = tl.load(expert_of_block_ptr + pid_m)
    row = tl.load(row_of_slot_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return e, row, row < ROWS


@triton.jit
def _tile(w_ptr, s_ptr, e, n, kk, N_OUT, K_IN, S_N, S_K, BLOCK: tl.constexpr, FP8: tl.constexpr):
    """Expert e's weight tile [BLOCK_K, BLOCK_N] (rows kk of the input, columns n of the output), in float32."""
    ok = (kk[:, None] < K_IN) & (n[None, :] < N_OUT)
    e = e.to(tl.int64)  # experts x rows x columns passes 2^31 on the largest models
    b = tl.load(w_ptr + e * N_OUT * K_IN + n[None, :] * K_IN + kk[:, None], mask=ok, other=0.0).to(tl.float32)
    if FP8:
        s = tl.load(s_ptr + e * S_N * S_K + (n[None, :] // BLOCK) * S_K + kk[:, None] // BLOCK, mask=ok, other=0.0)
        b = b * s
    return b


@triton.jit
def gate_up_silu(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    row_of_slot_ptr,
    expert_of_block_ptr,
    ROWS,
    TOP_K: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    S_N,
    S_K,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, row, valid = _block_rows(row_of_slot_ptr, expert_of_block_ptr, ROWS, BLOCK_M)
    if e < 0:
        return
    token = row // TOP_K
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + token[:, None] * H + kk[None, :], mask=valid[:, None] & (kk[None, :] < H), other=0.0)
        a = a.to(tl.float32)
        bg = _tile(w_ptr, s_ptr, e, n, kk, 2 * INTER, H, S_N, S_K, BLOCK, FP8)
        bu = _tile(w_ptr, s_ptr, e, n + INTER, kk, 2 * INTER, H, S_N, S_K, BLOCK, FP8)
        gate += tl.dot(a, bg, input_precision="ieee")
        up += tl.dot(a, bu, input_precision="ieee")
    h = gate / (1.0 + tl.exp(-gate)) * up
    ok = valid[:, None] & (n[None, :] < INTER)
    tl.store(out_ptr + row[:, None] * INTER + n[None, :], h.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def down_weighted(
    h_ptr,
    w_ptr,
    s_ptr,
    route_w_ptr,
    out_ptr,
    row_of_slot_ptr,
    expert_of_block_ptr,
    ROWS,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    S_N,
    S_K,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, row, valid = _block_rows(row_of_slot_ptr, expert_of_block_ptr, ROWS, BLOCK_M)
    if e < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + row[:, None] * INTER + kk[None, :], mask=valid[:, None] & (kk[None, :] < INTER), other=0)
        b = _tile(w_ptr, s_ptr, e, n, kk, HIDDEN, INTER, S_N, S_K, BLOCK, FP8)
        acc += tl.dot(a.to(tl.float32), b, input_precision="ieee")
    weight = tl.load(route_w_ptr + row, mask=valid, other=0.0)
    ok = valid[:, None] & (n[None, :] < HIDDEN)
    tl.store(out_ptr + row[:, None] * HIDDEN + n[None, :], acc * weight[:, None], mask=ok)
