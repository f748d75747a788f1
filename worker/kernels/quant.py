"""Groupwise weight quantization (GGUF blocks kept as they are, round-to-nearest for dense checkpoints) and the CPU
kernels that run it: `qlinear` (csrc/cpu_kernels.cpp) where built, else torch's int4 kernel.

A weight loads as a `QTensor`, sliced by every rank like a dense weight; `pack` makes a kernel's layout. Each row
runs alone in a fixed order, so verify and decode rows get the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.config import QUANTIZATION_CHOICES
from worker.kernels import cpu as cpu_kernels
from worker.kernels import cpu_choice

GROUP = 32  # GGUF's block size, and the kernel's group size
METHOD_BITS = {"int4": 4, "int8": 8}  # the methods that quantize every linear at load, and their width

# GGUF tensor types by how they load. Kept as they are: blocks of 32 map onto the kernel's groups code for code.
GGUF_EXACT = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# Requantized at load (round-to-nearest, groups of 32) to this many bits; dense under --quantization none.
GGUF_REQUANT = {"Q4_K": 4, "Q5_K": 4, "Q5_0": 4, "Q5_1": 4, "Q2_K": 4, "Q3_K": 4, "Q6_K": 8}
GGUF_DENSE = ("F32", "F16", "BF16")
GGUF_SUPPORTED = (*GGUF_DENSE, *GGUF_EXACT, *GGUF_REQUANT)


@dataclass(frozen=True)
class QTensor:
    """A [N, K] weight as w = q * scale + offset per group of GROUP columns.

    bits 4: q in 0..15 (uint8); bits 8: q in -128..127 (int8). scale and offset are float32 [N, K // GROUP].
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, index) -> QTensor:
        """A row slice or an index tensor of rows: what column-parallel and vocabulary shards take."""
        return QTensor(self.q[index], self.scale[index], self.offset[index], self.bits)

    def cols(self, start: int, stop: int) -> QTensor:
        """A column range (row-parallel shards); it must fall on group boundaries."""
        if start % GROUP or stop % GROUP:
            raise ValueError(
                f"a shard of columns {start}:{stop} splits a quantization group of {GROUP}; "
                "choose a tp size that divides the input dimension into multiples of 32"
            )
        g0, g1 = start // GROUP, stop // GROUP
        return QTensor(self.q[:, start:stop], self.scale[:, g0:g1], self.offset[:, g0:g1], self.bits)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.view(n, k // GROUP, GROUP).float()
        return (q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).view(n, k)


def cat_rows(parts: list[QTensor]) -> QTensor:
    """Stack row pieces; where widths differ (Q4_K q/k beside a Q6_K v), 4-bit codes widen to 8 bits exactly."""
    bits = max(p.bits for p in parts)
    q = [p.q.to(torch.int8) if p.bits < bits else p.q for p in parts]
    return QTensor(torch.cat(q), torch.cat([p.scale for p in parts]), torch.cat([p.offset for p in parts]), bits)


def zero_rows(n: int, k: int, bits: int) -> QTensor:
    """Padding rows (the last vocabulary shard) that dequantize to zero."""
    dtype = torch.uint8 if bits == 4 else torch.int8
    z = torch.zeros(n, k // GROUP)
    return QTensor(torch.zeros(n, k, dtype=dtype), z, z.clone(), bits)


def quantize_rtn(w: torch.Tensor, bits: int) -> QTensor:
    """Round-to-nearest per group of 32: asymmetric min/max for 4 bits (as GGUF Q4_1), symmetric for 8 (Q8_0)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"input dimension {k} is not a multiple of the quantization group {GROUP}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = ((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        return QTensor(q.view(n, k), scale, lo, 4)
    if bits == 8:
        scale = g.abs().amax(-1) / 127
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = (g * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return QTensor(q.view(n, k), scale, torch.zeros_like(scale), 8)
    raise ValueError(f"unsupported bit width {bits}")


def _f16(raw: np.ndarray, start: int) -> torch.Tensor:
    halves = np.ascontiguousarray(raw[:, :, start : start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(halves.astype(np.float32))


def gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QTensor:
    """Q4_0, Q4_1 or Q8_0 blocks of a [N, K] tensor (raw uint8 rows from gguf's reader) as a QTensor, unchanged."""
    n, k = shape
    nb = k // GROUP
    blocks = raw.reshape(n, nb, -1)
    if type_name == "Q8_0":
        d = _f16(blocks, 0)
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:34]).view(np.int8)).reshape(n, k)
        return QTensor(q, d, torch.zeros_like(d), 8)
    d = _f16(blocks, 0)
    body = 2 if type_name == "Q4_0" else 4
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, body : body + 16]))  # byte j: elements j (low), j+16
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
    offset = -8 * d if type_name == "Q4_0" else _f16(blocks, 2)
    return QTensor(q, d, offset, 4)


@dataclass(frozen=True)
class Int4Weight:
    """A weight in torch's CPU int4 kernel's layout (the fallback): `planes` 4-bit planes side by side along K
    (8-bit codes as q = 16*hi + lo), with scales in the activation dtype, so float16 GGUF scales lose 3 bits."""

    packed: torch.Tensor  # uint8, the kernel's own layout
    scale_zero: torch.Tensor  # [planes * K / GROUP, N, 2] in the activation dtype
    planes: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.scale_zero.dtype


# cpu_kernels.qlinear's variants: how it multiplies, and so the layout its codes are packed in
QLINEAR_VARIANTS = {"bf16": 0, "int8act": 1, "reference": 2}


@dataclass(frozen=True)
class QBlocks:
    """A weight in `cpu_kernels.qlinear`'s layout for one variant: blocks of 16 outputs (zero-padded), the codes of
    each block and group of 32 inputs side by side as the variant's dot products take them (`bf16`: input pairs,
    `int8act`: input quads, see the kernels' comments), and float16 scale and offset per block and group."""

    codes: torch.Tensor  # uint8 (4 bits, two codes a byte) or int8, [blocks, groups, 16 * 32 * bits / 8]
    scale_offset: torch.Tensor  # float16 [blocks, groups, 2, 16]
    bits: int
    out_features: int
    in_features: int
    dtype: torch.dtype  # the activations' dtype
    kernel: Callable = field(repr=False, compare=False)  # cpu_kernels' qlinear: the layout is this build's
    layout: str = "bf16"  # the variant it runs: "bf16" or "int8act"

    @property
    def variant(self) -> int:
        return QLINEAR_VARIANTS[self.layout]

    def __call__(self, x: torch.Tensor, variant: int | None = None) -> torch.Tensor:
        """x [M, K] -> [M, out_features]; `variant` "reference" (2) runs the bf16 layout's portable float32 sums."""
        if variant is None:
            variant = self.variant
        elif variant != self.variant and not (variant == QLINEAR_VARIANTS["reference"] and self.layout == "bf16"):
            raise ValueError(f"qlinear variant {variant} cannot read codes packed for {self.layout}")
        return self.kernel(x, self.codes, self.scale_offset, self.bits, self.out_features, variant)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale_offset.nbytes

    def qtensor(self) -> QTensor:
        """The weight back as a QTensor (scales as float16 kept them): to repack it for another kernel."""
        blocks, groups, _ = self.codes.shape
        if self.layout == "int8act" and self.bits == 4:  # [block, group, vector, lane, 4 bytes] -> nibbles last
            b = self.codes.view(blocks, groups, 4, 16, 4)
            q = torch.stack([b & 15, b >> 4], dim=-1).permute(0, 3, 1, 2, 5, 4)  # [block, lane, group, v, half, j]
        elif self.layout == "int8act":
            q = self.codes.view(blocks, groups, 8, 16, 4).permute(0, 3, 1, 2, 4)
        elif self.bits == 4:
            pairs = self.codes.view(blocks, groups, GROUP // 4, 16, 2)
            quads = torch.cat([pairs & 15, pairs >> 4], dim=-1)  # [block, group, quad, lane, 4]
            q = quads.permute(0, 3, 1, 2, 4)
        else:
            q = self.codes.view(blocks, groups, GROUP // 2, 16, 2).permute(0, 3, 1, 2, 4)
        q = q.reshape(blocks * 16, self.in_features)[: self.out_features]
        scale, offset = (
            self.scale_offset[:, :, i].permute(0, 2, 1).reshape(blocks * 16, groups)[: self.out_features].float()
            for i in (0, 1)
        )
        return QTensor(q.contiguous(), scale.contiguous(), offset.contiguous(), self.bits)


def pack_blocks(qt: QTensor, dtype: torch.dtype, layout: str = "bf16") -> QBlocks:
    kernels = cpu_kernels.ops(torch.device("cpu"))
    if kernels is None:
        raise RuntimeError("the CPU kernels are not built, so there is no qlinear to pack for")
    n, k = qt.shape
    groups, blocks = k // GROUP, -(-n // 16)
    pad = blocks * 16 - n
    q, scale, offset = qt.q.contiguous(), qt.scale.contiguous(), qt.offset.contiguous()
    if pad:
        q = torch.cat([q, torch.zeros(pad, k, dtype=q.dtype)])
        scale, offset = (torch.cat([t, torch.zeros(pad, groups)]) for t in (scale, offset))
    if layout == "int8act" and qt.bits == 4:  # [block, group, vector v, lane, j]: inputs 8v + j | 8v + 4 + j << 4
        halves = q.view(blocks, 16, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        codes = halves[..., 0] | (halves[..., 1] << 4)
    elif layout == "int8act":  # [block, group, vector v, lane, j]: input 4v + j
        codes = q.view(blocks, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)
    elif qt.bits == 4:  # [block, group, quad of inputs, lane, 4]: byte = pair 2p (low nibble) | pair 2p + 1 (high)
        quads = q.view(blocks, 16, groups, GROUP // 4, 4).permute(0, 2, 3, 1, 4)
        codes = quads[..., :2] | (quads[..., 2:] << 4)
    else:  # [block, group, pair, lane, 2]
        codes = q.view(blocks, 16, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    lanes = [t.view(blocks, 16, groups).permute(0, 2, 1) for t in (scale, offset)]
    return QBlocks(
        codes.contiguous().view(blocks, groups, -1),
        torch.stack(lanes, dim=2).half().contiguous(),
        qt.bits,
        n,
        k,
        dtype,
        kernels.qlinear,
        layout,
    )


def pack(qt: QTensor, dtype: torch.dtype = torch.bfloat16) -> QBlocks | Int4Weight:
    """The layout of this process's CPU kernel (cpu_choice: bf16 or int8act) where it applies (bfloat16
    activations, or float32 on int8act; scales within float16's range), else torch's int4 kernel's (`portable`;
    qlinear's float32 reference path is for tests, not for serving)."""
    kernel = cpu_choice.active().name
    usable = dtype == torch.bfloat16 or (dtype == torch.float32 and kernel == "int8act")
    if usable and kernel != "portable" and _fp16_exact_enough(qt):
        return pack_blocks(qt, dtype, kernel)
    return pack_int4(qt, dtype)


def _fp16_exact_enough(qt: QTensor) -> bool:
    """float16 keeps GGUF's scales exactly and a float32 scale to 2^-11; a scale out of its range (or subnormal
    there) would lose more than torch's bfloat16 scales do, so such a weight takes torch's kernel."""
    for t in (qt.scale, qt.offset):
        err = (t.half().float() - t).abs()
        if bool((err > t.abs() * 2.0**-10).any()):
            return False
    return True


def pack_int4(qt: QTensor, dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    """The kernel computes (u - 8) * s + z for a 4-bit code u. 4 bits: u = q, z = offset + 8s. 8 bits: two planes,
    hi = q >> 4 in -8..7 as u = hi + 8 with s = 16d, z = offset, and lo = q & 15 with s = d, z = 8d."""
    n, k = qt.shape
    if qt.bits == 4:
        codes, scales, zeros = [qt.q], [qt.scale], [qt.offset + 8 * qt.scale]
    else:
        q = qt.q.to(torch.int16)
        codes = [(q >> 4) + 8, q & 15]
        scales = [16 * qt.scale, qt.scale]
        zeros = [qt.offset, 8 * qt.scale]
    codes_all = torch.cat([c.to(torch.int32) for c in codes], dim=1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_all.contiguous(), 1)
    sz = torch.stack([torch.cat(scales, dim=1), torch.cat(zeros, dim=1)], dim=-1)  # [N, planes*K/G, 2]
    return Int4Weight(packed, sz.transpose(0, 1).contiguous().to(dtype), len(codes), n, k)


def int4_linear(x: torch.Tensor, w: QBlocks | Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if isinstance(w, QBlocks):
        y = w(x2)
    else:
        if w.planes == 2:
            x2 = torch.cat([x2, x2], dim=-1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), w.packed, GROUP, w.scale_zero)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], w.out_features)


def quantized_activations(dtype: torch.dtype, device: torch.device, dtype_name: str = "bfloat16") -> bool:
    """Whether quantized weights run with these activations: bfloat16 on CPU (every kernel), or float32 on CPU with
    `--cpu-kernel int8act` where the dtype was left to `auto` (its served numerics: float32 between the linears, as
    llama.cpp). Under `--quantization auto` an explicit `--dtype float32` is the exact reference and keeps dense
    weights; an explicit int4/int8 quantizes with float32 activations on int8act."""
    if device.type != "cpu":
        return False
    return dtype == torch.bfloat16 or (
        dtype == torch.float32 and dtype_name == "auto" and cpu_choice.active().name == "int8act"
    )


def resolve_quantization(
    method: str, dtype: torch.dtype, device: torch.device, checkpoint_kind: str, dtype_name: str = "bfloat16"
) -> str:
    """The method a load actually uses: 'none', 'int4', 'int8' or 'gguf' (keep the file's own blocks).

    The kernels take bfloat16 activations on CPU, or float32 ones on int8act (`quantized_activations`); `auto` falls
    back to dense elsewhere (float32 runs stay the exact reference), an explicit int4/int8 there is refused."""
    if method not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATION_CHOICES)}")
    if method == "none":
        return "none"
    fast = quantized_activations(dtype, device, dtype_name if method == "auto" else "auto")
    if method == "auto":
        return "gguf" if fast and checkpoint_kind == "gguf" else "none"
    if not fast:
        raise ValueError(
            f"--quantization {method} runs on CPU with bfloat16 activations (or float32 ones on --cpu-kernel "
            f"int8act); this load has {str(dtype).removeprefix('torch.')} on {device.type} (use --dtype bfloat16, "
            "or --quantization none)"
        )
    return method
