"""Which kernel multiplies the quantized weights on CPU (`--cpu-kernel`), chosen once per process at start-up.

- `bf16`: bfloat16 activations by AVX512-BF16 dot products (AMX tiles where the CPU has them); the activations are
  exact, only the weights are quantized.
- `int8act`: activations quantized per row to 8 bits in groups of 32 (llama.cpp's Q8_0) and multiplied with the
  4- or 8-bit codes by integer dot products, on AVX512-VNNI or AVX2: "4-bit weights x 8-bit activations", as
  llama.cpp computes.
- `portable`: torch's int4 kernel (scales in the activations' dtype), on any CPU.

`auto` takes the first of these the build runs. Every variant computes each row alone, so speculative output stays
exactly plain output on each; a process never mixes them, and the ranks of a group agree on one at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from worker.config import CPU_KERNEL_CHOICES
from worker.kernels import cpu as cpu_kernels
from worker.kernels import cpu_class
from worker.kernels.cpu_class import cpu_flags

log = logging.getLogger(__name__)

# the CPU features each variant needs, as /proc/cpuinfo names them (any one of the alternatives)
NEEDS = {"bf16": (("avx512_bf16", "avx512bw"),), "int8act": (("avx512_vnni", "avx512bw"), ("avx2", "fma", "f16c"))}


@dataclass(frozen=True)
class CpuKernel:
    name: str  # bf16 | int8act | portable
    isa: str  # what it runs on: amx_bf16, avx512_bf16, avx512_vnni, avx2, or torch's int4 kernel

    def __str__(self) -> str:
        return f"{self.name} ({self.isa})"


PORTABLE = CpuKernel("portable", "torch int4 kernel")
_active: CpuKernel | None = None


def built() -> dict[str, str]:
    """The variants this process's build of the CPU kernels runs, by name, with their instruction set."""
    kernels = cpu_kernels.ops(torch.device("cpu"))
    isa = dict(kernels.qlinear_isa()) if kernels is not None else {}
    return {name: isa[name] for name in ("bf16", "int8act") if isa.get(name)}


def resolve(choice: str) -> CpuKernel:
    """The variant `choice` means here; a variant this CPU (or build) cannot run is an error that says why."""
    if choice not in CPU_KERNEL_CHOICES:
        raise ValueError(f"unknown --cpu-kernel {choice!r}; choose one of {', '.join(CPU_KERNEL_CHOICES)}")
    if choice == "portable":
        return PORTABLE
    have = built()
    if choice == "auto":
        name = next((n for n in ("bf16", "int8act") if n in have), None)
        return CpuKernel(name, have[name]) if name else PORTABLE
    if choice in have:
        return CpuKernel(choice, have[choice])
    flags = cpu_flags()
    options = " or ".join("+".join(need) for need in NEEDS[choice])
    missing = sorted({f for need in NEEDS[choice] for f in need} - flags)
    if cpu_kernels.ops(torch.device("cpu")) is None:
        why = "the CPU kernels did not build here (see the warning above)"
    elif any(all(f in flags for f in need) for need in NEEDS[choice]):
        extra = " ".join(cpu_kernels.EXTRA_FLAGS)
        how = f"EAGLEGATE_CPU_FLAGS={extra}" if extra else "the compiler's -march=native did not enable them"
        why = f"this CPU has them but the kernels were built without ({how})"
    else:
        why = f"this CPU lacks {', '.join(missing)}"
    usable = ", ".join(["portable", *have])
    raise ValueError(f"--cpu-kernel {choice} needs the CPU feature {options}: {why}; this machine runs {usable}")


def select(choice: str) -> CpuKernel:
    """Resolve `choice` and make it this process's variant (quant.pack packs for it); logged once."""
    global _active
    _active = resolve(choice)
    log.info("CPU kernel for quantized linears: %s (--cpu-kernel %s)%s", _active, choice, cpu_class.passing_note())
    return _active


def active() -> CpuKernel:
    """This process's variant: the one `select` chose, else auto's (unlogged: the engine's ranks select and log)."""
    global _active
    if _active is None:
        _active = resolve("auto")
    return _active
