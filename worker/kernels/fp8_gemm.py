"""Block-FP8 linear layers in Triton: y = x W^T with W kept as the checkpoint stores it (float8_e4m3fn codes and a
float32 scale per block of rows x columns, DeepSeek-V3's layout), so the weights stream half the bytes of bfloat16.

Each program computes a BLOCK_M x BLOCK_N tile of y; along K it loads a tile of codes, widens it to float32, applies
the tile's block scale, and accumulates the dot product in float32. BLOCK_N and BLOCK_K divide the checkpoint's
block, so a weight tile never straddles two scales. Activations stay in the model dtype (weight-only FP8: a decode
step is bound by weight bytes, which this halves). Tested on CPU under TRITON_INTERPRET=1 against dequantize-then-
matmul in float32 (tests/kernels/test_fp8_gemm.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class Fp8Tensor:
    """Block-FP8 codes and their per-block scales, as DeepSeek-V3's checkpoints store them: a checkpoint piece while
    loading (sliced only at block boundaries, so the scales slice with it), then a linear's weight for `fp8_linear`."""

    codes: torch.Tensor  # [rows, cols] float8_e4m3fn
    scale: torch.Tensor  # [ceil(rows / block[0]), ceil(cols / block[1])] float32
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def rows(self, sl: slice) -> Fp8Tensor:
        start, stop = _aligned(sl.start, sl.stop, self.shape[0], self.block[0], "rows")
        scale = self.scale[start // self.block[0] : -(-stop // self.block[0])]
        return Fp8Tensor(self.codes[start:stop], scale, self.block)

    def cols(self, start: int, stop: int) -> Fp8Tensor:
        start, stop = _aligned(start, stop, self.shape[1], self.block[1], "columns")
        scale = self.scale[:, start // self.block[1] : -(-stop // self.block[1])]
        return Fp8Tensor(self.codes[:, start:stop], scale, self.block)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: each code times its block's scale."""
        rows, cols = self.shape
        full = self.scale.float().repeat_interleave(self.block[0], 0)[:rows]
        return self.codes.float() * full.repeat_interleave(self.block[1], 1)[:, :cols]


def _aligned(start: int | None, stop: int | None, size: int, block: int, what: str) -> tuple[int, int]:
    start, stop = start or 0, size if stop is None else min(stop, size)
    if start % block or (stop % block and stop != size):
        raise ValueError(f"a shard of {what} {start}:{stop} splits a block-FP8 block of {block}")
    return start, stop


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def block_fp8_matmul(
        x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
        BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        scale_row = (pid_n * BLOCK_N) // BN_SCALE  # BLOCK_N divides BN_SCALE: the whole tile shares it
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], (rm[:, None] < M) & (kk[None, :] < K), 0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], (rn[:, None] < N) & (kk[None, :] < K), 0.0)
            s = tl.load(s_ptr + scale_row * stride_sn + k0 // BK_SCALE)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32))) * s
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, (rm[:, None] < M) & (rn[None, :] < N))

    return block_fp8_matmul


def _tile(limit: int, block: int) -> int:
    """The largest power of two up to `limit` that divides the scale block."""
    t = limit
    while block % t:
        t //= 2
    return t


def fp8_linear(x: torch.Tensor, w: Fp8Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] in any float dtype -> [..., out] in x's dtype, accumulated in float32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    M, K = x2.shape
    N = w.out_features
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M:
        bm = 16 if M <= 16 else 64
        bn, bk = _tile(64, w.block[0]), _tile(64, w.block[1])
        grid = (-(-M // bm), -(-N // bn))
        _kernel()[grid](
            x2, w.codes, w.scale, y, M, N, K, x2.stride(0), w.codes.stride(0), w.scale.stride(0), y.stride(0),
            BN_SCALE=w.block[0], BK_SCALE=w.block[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        )  # fmt: skip
    y = y.to(x.dtype).view(*shape[:-1], N)
    return y if bias is None else y + bias
