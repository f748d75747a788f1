"""Block-FP8 checkpoints (DeepSeek-V3, GLM-4.x FP8): `quantization_config.quant_method: fp8` with
`weight_block_size: [128, 128]`. Each quantized linear stores `W.weight` in float8_e4m3fn and `W.weight_scale_inv`,
one float32 per block of rows x columns (ceil(out / 128) x ceil(in / 128)), and `W = weight * scale` block-wise.

On GPUs (`--quantization auto` or `fp8`) the linears keep the checkpoint's bytes: each rank's shard of codes and scales
(`Fp8Tensor` pieces, sliced at block boundaries) is stacked into one `Fp8Tensor` for the Triton GEMM in
worker/kernels/fp8_gemm.py. Elsewhere, or where a rank's shard would split a block, they load dequantized to float32
as the checkpoint streams past, before the serving dtype or --quantization's int4/int8 packing sees them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from worker.kernels.fp8_gemm import Fp8Tensor
from worker.model.files import ModelLoadError

logger = logging.getLogger("eaglegate.fp8")
SCALE_SUFFIX = "_scale_inv"


def block_size(hf_config: dict) -> tuple[int, int] | None:
    """The checkpoint's FP8 block (rows, columns), or None for a checkpoint that is not block-FP8."""
    q = hf_config.get("quantization_config") or {}
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ModelLoadError(
            f"checkpoint quantization {q.get('quant_method')!r} is not supported; supported: fp8 (block-wise), or an "
            f"unquantized checkpoint with --quantization int4/int8"
        )
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"FP8 checkpoint without a valid weight_block_size (got {block!r}); only block-FP8 loads")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"FP8 activation_scheme {q['activation_scheme']!r} is not supported (dynamic only)")
    return block[0], block[1]


def check_scale(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if scale.dim() != 2 or tuple(scale.shape) != want:
        raise ModelLoadError(
            f"{name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}; {name} of shape {(rows, cols)} in blocks of "
            f"{list(block)} needs {want}"
        )


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    check_scale(name, weight, scale, block)
    return Fp8Tensor(weight, scale, block).dequantize()


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes, float32 scale per block) with each block's largest magnitude at e4m3's largest finite value:
    the checkpoints' own scheme, for tests and for making a block-FP8 copy of a float model."""
    rows, cols = w.shape
    pad = torch.nn.functional.pad(w.float(), (0, -cols % block[1], 0, -rows % block[0]))
    tiles = pad.view(pad.shape[0] // block[0], block[0], pad.shape[1] // block[1], block[1])
    scale = (tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def dequantize_stream(
    tensors: Iterator[tuple[str, torch.Tensor]], block: tuple[int, int], keep: bool = False
) -> Iterator[tuple[str, torch.Tensor | Fp8Tensor]]:
    """The checkpoint's tensors with each FP8 weight joined to its scale: dequantized to float32, or kept as an
    `Fp8Tensor`; the others pass through. A weight waits for its scale (or the scale for its weight) when the files
    hold them apart."""
    waiting: dict[str, torch.Tensor] = {}
    count = 0
    for name, t in tensors:
        if name.endswith(SCALE_SUFFIX):
            weight_name, scale = name.removesuffix(SCALE_SUFFIX), t
            weight = waiting.pop(weight_name, None)
            if weight is None:
                waiting[name] = t
                continue
        elif t.dtype == torch.float8_e4m3fn:
            weight_name, weight = name, t
            scale = waiting.pop(name + SCALE_SUFFIX, None)
            if scale is None:
                waiting[name] = t
                continue
        else:
            yield name, t
            continue
        count += 1
        if keep:
            check_scale(weight_name, weight, scale, block)
            yield weight_name, Fp8Tensor(weight, scale.float(), block)
        else:
            yield weight_name, dequantize(weight_name, weight, scale, block)
    if waiting:
        first = sorted(waiting)[0]
        partner = first.removesuffix(SCALE_SUFFIX) if first.endswith(SCALE_SUFFIX) else first + SCALE_SUFFIX
        raise ModelLoadError(f"block-FP8 checkpoint has {first} but no {partner} ({len(waiting)} unpaired tensors)")
    logger.info("%s %d block-FP8 weights (blocks of %s)", "kept" if keep else "dequantized", count, list(block))
