"""The block-FP8 Triton GEMM (worker/kernels/fp8_gemm.py) under TRITON_INTERPRET=1 against a float32 reference:
dequantize the codes block by block, then matmul."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.fp8_gemm import Fp8Tensor, fp8_linear
from worker.model.fp8 import dequantize, quantize


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "dtype"),
    [
        (1, 256, 128, (128, 128), torch.bfloat16),  # a decode row, the published block
        (5, 200, 96, (32, 32), torch.float32),  # ragged: the last row block and column block are partial
        (40, 96, 160, (32, 64), torch.bfloat16),  # several row tiles, rectangular blocks
    ],
)
def test_fp8_linear_matches_dequantized_float32(m, n, k, block, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # scales that differ by row block
    codes, scale = quantize(w, block)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    out = fp8_linear(x, Fp8Tensor(codes, scale, block), bias)
    ref = x.float() @ dequantize("w", codes, scale, block).T + bias.float()
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the float32 result
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() <= tol


def test_fp8_linear_keeps_leading_dims_and_empty_batches():
    codes, scale = quantize(torch.randn(64, 64), (32, 32))
    w = Fp8Tensor(codes, scale, (32, 32))
    assert fp8_linear(torch.randn(2, 3, 64), w).shape == (2, 3, 64)
    assert fp8_linear(torch.randn(0, 64), w).shape == (0, 64)
