"""What this CPU can run, as the project sees it, and a switch that makes a larger CPU pass for a smaller one.

`EAGLEGATE_CPU_CLASS` (`make test-cpu CLASS=avx2`) names a CPU class; the process and every rank it spawns then
behave as on that class where they can:

| class | such as | kernels build | torch's dispatch | oneDNN's ISA | oneDNN bfloat16 linear |
| --- | --- | --- | --- | --- | --- |
| `avx2` | AMD Zen 2/3, Intel Haswell to Comet Lake | `-march=haswell` | `ATEN_CPU_CAPABILITY=avx2` | AVX2 | refused |
| `avx512_vnni` | Intel Cascade Lake | no AVX512-BF16, no AMX | avx512 | AVX512_CORE_VNNI | yes |
| `avx512_bf16` | AMD Zen 4, Intel Cooper Lake | no AMX | avx512 | AVX512_CORE_BF16 | yes |

`cpu_flags()` hides what the class lacks, so `--cpu-kernel` chooses and refuses as it would there, and
`onednn_bf16_linear()` is the one predicate every oneDNN bfloat16 weight packing checks.

What it cannot simulate: checks torch and oneDNN make from CPUID inside their own kernels. On this CPU they still
find AVX-512, so a bfloat16 `F.linear` (torch's fallback where oneDNN's packed linear is refused) runs through
oneDNN's matmul here but through ATen's generic GEMM on a real AVX2-only CPU, and instructions the class lacks may
still run inside torch's own libraries. The switch shows which paths the project takes, not their speed there.

Kept free of torch imports: `worker/__init__.py` applies the class's environment before torch reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENV = "EAGLEGATE_CPU_CLASS"
ONEDNN_BF16_FLAGS = ("avx512bw", "avx512vl", "avx512dq")  # what torch's oneDNN bfloat16 linear checks for
NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


@dataclass(frozen=True)
class CpuClass:
    name: str
    hides: tuple[str, ...]  # prefixes of /proc/cpuinfo flags this class lacks
    cflags: tuple[str, ...]  # compiler flags that build the CPU kernels as for this class
    aten: str  # ATEN_CPU_CAPABILITY
    onednn: str  # ONEDNN_MAX_CPU_ISA


CLASSES = {
    c.name: c
    for c in (
        CpuClass("avx2", ("avx512", "amx", "avx_vnni", "avx_ne_convert"), ("-march=haswell",), "avx2", "AVX2"),
        CpuClass(
            "avx512_vnni",
            ("avx512_bf16", "avx512_fp16", "amx", "avx_ne_convert"),
            ("-mno-avx512bf16", "-mno-avx512fp16", *NO_AMX),
            "avx512",
            "AVX512_CORE_VNNI",
        ),
        CpuClass("avx512_bf16", ("amx",), NO_AMX, "avx512", "AVX512_CORE_BF16"),
    )
}


def active() -> CpuClass | None:
    """The class this process passes for, or None for the CPU as it is."""
    name = os.environ.get(ENV, "").strip().lower()
    if name in ("", "native"):
        return None
    if name not in CLASSES:
        raise ValueError(f"unknown {ENV}={name!r}; choose one of native, {', '.join(CLASSES)}")
    return CLASSES[name]


def apply_env() -> None:
    """Point torch and oneDNN at the class (set before they read it; spawned ranks inherit it)."""
    c = active()
    if c is not None:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", c.aten)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", c.onednn)


def build_flags() -> list[str]:
    """Compiler flags for the CPU kernels beyond -march=native: the class's, then `EAGLEGATE_CPU_FLAGS`."""
    c = active()
    flags = [*(c.cflags if c else ()), *os.environ.get("EAGLEGATE_CPU_FLAGS", "").split()]
    return list(dict.fromkeys(flags))  # once each: the build directory is keyed by them


@cache
def _raw_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo names them, less what the active class lacks."""
    c = active()
    return {f for f in _raw_flags() if not (c and f.startswith(c.hides))}


def onednn_bf16_linear() -> bool:
    """Whether torch's oneDNN bfloat16 linear (`mkldnn._reorder_linear_weight`) runs here: it needs AVX512BW, VL and
    DQ or AVX-NE-CONVERT, checked by torch from CPUID. Elsewhere bfloat16 linears take torch's generic path."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    if active() is not None:
        flags = cpu_flags()
        return all(f in flags for f in ONEDNN_BF16_FLAGS) or "avx_ne_convert" in flags
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def describe() -> str:
    """One line for logs and the closing notes: the flags that decide the CPU paths, and the class if one is set."""
    keep = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_ne_convert")
    have = " ".join(f for f in keep if f in cpu_flags()) or "none of " + " ".join(keep)
    c = active()
    return f"{have} (passing for {c.name})" if c else have


def passing_note() -> str:
    """What a log line about the CPU adds while a class is set: ', passing for a CPU of class avx2 (...)', or ''."""
    c = active()
    return f", passing for a CPU of class {c.name} ({ENV})" if c else ""
