"""qlinear's 8-bit-activation variant (csrc/qlinear_int8act.h), the kernel of CPUs without AVX512-BF16, against an
independent integer reference and a float32 matmul, on each build this CPU runs: `-march=native` (AVX512-VNNI where
the CPU has it) and `-march=haswell` (AVX2 alone, as on CPUs without AVX-512), built here in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.kernels import cpu as cpu_kernels
from worker.kernels import cpu_choice
from worker.kernels.quant import QBlocks, QTensor, pack_blocks, quantize_rtn

ROOT = Path(__file__).resolve().parents[2]
HASWELL = {"EAGLEGATE_CPU_FLAGS": "-march=haswell"}  # no AVX-512: the AVX2 path, on any x86 CPU with AVX2
# 8-bit activations cost about 0.4% of the largest output against the float32 matmul here (bfloat16 activations:
# 0.25%); the bound leaves room for unlucky rows
FLOAT32_TOLERANCE = 0.015
ROW_SETS = (slice(2, 3), slice(4, 6), slice(1, 8), slice(0, 8), slice(0, 13))  # 1, 2, 7, 8 and 13 rows


def _need_int8act() -> None:
    if "int8act" not in cpu_choice.built():
        pytest.skip("needs AVX2: this CPU runs no integer-activation kernel")


def integer_reference(x: torch.Tensor, qt: QTensor) -> torch.Tensor:
    """The variant's arithmetic in plain torch, float64 at the end: each row's groups of 32 as Q8_0 codes, exact
    integer sums with the weight codes, then scale and offset (float16, as packed)."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    a = torch.round(xg * inv).to(torch.int64)  # half to even, as the kernel's nearbyint
    d = (amax / 127).double().squeeze(-1)  # [m, groups]
    q = qt.q.to(torch.int64).view(qt.shape[0], k // 32, 32)
    sums = torch.einsum("mgj,ngj->mng", a, q).double()  # [m, n, groups], exact
    scale, offset = qt.scale.half().double(), qt.offset.half().double()
    y = sums * scale.unsqueeze(0) * d.unsqueeze(1) + offset.unsqueeze(0) * (d * a.sum(-1).double()).unsqueeze(1)
    return y.sum(-1)


def _case(bits: int, seed: int = 0) -> tuple[QTensor, QBlocks, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + bits)
    qt = quantize_rtn(torch.randn(200, 512, generator=g) * 0.05, bits)  # 13 blocks, the last one partial
    x = torch.randn(13, 512, generator=g) * torch.logspace(-4, 2, 13).unsqueeze(1)
    x[4] = 0
    x[7, 100:140] = 0  # a group of zeros beside live ones
    return qt, pack_blocks(qt, torch.bfloat16, "int8act"), x.bfloat16()


@pytest.mark.parametrize("bits", [4, 8])
def test_int8act_matches_the_integer_reference_and_float32(bits):
    _need_int8act()
    qt, packed, x = _case(bits)
    out = packed(x.float())  # float32 activations (the same values) keep the float32 sums unrounded
    assert torch.equal(packed(x), out.bfloat16())
    ints = integer_reference(x, qt)
    assert ((out.double() - ints).abs() <= ints.abs().amax(-1, keepdim=True) * 1e-6 + 1e-30).all()
    ref = x.float() @ qt.dequantize().t()
    rel = (out - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    assert rel.max() < FLOAT32_TOLERANCE and torch.equal(out[4], torch.zeros(200))
    for rows in ROW_SETS:  # a row's bits never depend on the rows beside it: verify rows equal decode rows
        assert torch.equal(packed(x[rows].float()), out[rows])
    assert torch.equal(packed.qtensor().q, qt.q)  # the layout keeps every code


def _run_build(env: dict[str, str], script: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=os.environ | env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


HASWELL_SCRIPT = """
import json, torch
from tests.kernels.test_int8act import _case
from worker.kernels import cpu_choice
outs = {}
for bits in (4, 8):
    qt, packed, x = _case(bits)
    outs[bits] = packed(x.float()).tolist()
try:
    cpu_choice.resolve("bf16")
    refusal = None
except ValueError as e:
    refusal = str(e)
print(json.dumps({"built": cpu_choice.built(), "auto": str(cpu_choice.resolve("auto")), "outs": outs,
                  "refusal": refusal}))
"""


@pytest.fixture(scope="session")
def haswell_build():
    """What the -march=haswell build computes and says (built once, about 40 s, then cached in .cache/)."""
    if cpu_kernels.ops(torch.device("cpu")) is None:
        pytest.skip("the CPU kernels are not built here")
    if "avx2" not in cpu_choice.cpu_flags():
        pytest.skip("needs AVX2 to run the -march=haswell build")
    return _run_build(HASWELL, HASWELL_SCRIPT)


def test_the_avx2_build_gives_the_native_builds_bits_and_names_what_it_lacks(haswell_build):
    """Both builds compute the same integers and the same float32 operations in the same order: the AVX2 kernel (two
    halves of 8 lanes, vpmaddubsw) gives the AVX512-VNNI kernel's (16 lanes, vpdpbusd) bits exactly."""
    assert haswell_build["built"] == {"int8act": "avx2"} and haswell_build["auto"] == "int8act (avx2)"
    # where this CPU has AVX512-BF16 the refusal names the build flag that left it out, elsewhere the missing feature
    has_bf16 = {"avx512_bf16", "avx512bw"} <= cpu_choice.cpu_flags()
    assert "avx512_bf16" in haswell_build["refusal"]
    assert ("EAGLEGATE_CPU_FLAGS" if has_bf16 else "this CPU lacks") in haswell_build["refusal"]
    for bits in (4, 8):
        qt, packed, x = _case(bits)
        avx2 = torch.tensor(haswell_build["outs"][str(bits)])
        assert torch.equal(avx2, packed(x.float()))
        ref = x.float() @ qt.dequantize().t()
        assert ((avx2 - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)).max() < FLOAT32_TOLERANCE


def test_forcing_a_variant_the_cpu_lacks_names_the_missing_feature(monkeypatch):
    monkeypatch.setattr(cpu_choice, "built", lambda: {"int8act": "avx2"})
    monkeypatch.setattr(cpu_choice, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})
    with pytest.raises(
        ValueError,
        match=r"--cpu-kernel bf16 needs the CPU feature avx512_bf16\+avx512bw: this CPU "
        r"lacks avx512_bf16, avx512bw; this machine runs portable, int8act",
    ):
        cpu_choice.resolve("bf16")
    assert cpu_choice.resolve("auto") == cpu_choice.CpuKernel("int8act", "avx2")
    monkeypatch.setattr(cpu_choice, "built", lambda: {})
    monkeypatch.setattr(cpu_choice, "cpu_flags", lambda: {"sse4_2"})
    with pytest.raises(ValueError, match="needs the CPU feature avx512_vnni.avx512bw or avx2.fma.f16c: this CPU lacks"):
        cpu_choice.resolve("int8act")
    assert cpu_choice.resolve("auto") == cpu_choice.PORTABLE
