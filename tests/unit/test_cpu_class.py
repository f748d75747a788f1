"""EAGLEGATE_CPU_CLASS: a process passes for a smaller CPU in every place the project reads the CPU, and one predicate
guards every oneDNN bfloat16 packing."""

from __future__ import annotations

import pytest
import torch

from worker.kernels import cpu_class
from worker.model.layers import pack_cpu_linears
from worker.model.loader import resolve_dtype


def _linear() -> torch.nn.Module:
    mod = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    mod.packed, mod.qweight = None, None
    return mod


def test_the_avx2_class_hides_avx512_and_refuses_onednn_bfloat16(monkeypatch):
    monkeypatch.setenv(cpu_class.ENV, "avx2")
    flags = cpu_class.cpu_flags()
    assert not any(f.startswith(("avx512", "amx")) for f in flags)
    assert flags <= cpu_class._raw_flags()
    assert cpu_class.build_flags()[0] == "-march=haswell"
    monkeypatch.setenv("EAGLEGATE_CPU_FLAGS", "-march=haswell")
    assert cpu_class.build_flags() == ["-march=haswell"]  # once: the build directory is keyed by the flags
    assert not cpu_class.onednn_bf16_linear()
    mod = _linear()
    assert pack_cpu_linears(mod) == 0 and mod.packed is None
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32  # auto never picks the unpacked path
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # served, with a warning
    assert "(passing for avx2)" in cpu_class.describe()


def test_the_cascade_lake_class_keeps_avx512bw_but_not_bf16(monkeypatch):
    monkeypatch.setenv(cpu_class.ENV, "avx512_vnni")
    flags = cpu_class.cpu_flags()
    assert "avx512_bf16" not in flags and not any(f.startswith("amx") for f in flags)
    assert "-mno-avx512bf16" in cpu_class.build_flags()
    assert cpu_class.onednn_bf16_linear() == all(f in flags for f in cpu_class.ONEDNN_BF16_FLAGS)


def test_the_native_class_is_the_cpu_as_it_is(monkeypatch):
    monkeypatch.delenv(cpu_class.ENV, raising=False)
    assert cpu_class.active() is None and cpu_class.cpu_flags() == set(cpu_class._raw_flags())
    assert cpu_class.onednn_bf16_linear() == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    mod = _linear()
    assert pack_cpu_linears(mod) == int(cpu_class.onednn_bf16_linear())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    from worker.model.layers import linear

    assert torch.equal(linear(x, mod), torch.nn.functional.linear(x, mod.weight))  # packed or not, the same bits


def test_an_unknown_class_is_an_error_that_lists_the_classes(monkeypatch):
    monkeypatch.setenv(cpu_class.ENV, "avx10")
    with pytest.raises(ValueError, match="native, avx2, avx512_vnni, avx512_bf16"):
        cpu_class.active()
