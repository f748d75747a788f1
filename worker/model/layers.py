"""Tensor-parallel building blocks. Each parameter carries a weight_loader that takes the full
checkpoint tensor and keeps only this rank's shard, so no rank ever holds another's weights."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.dist import TPGroup
from worker.kernels import cpu as cpu_kernels
from worker.kernels.cpu_class import onednn_bf16_linear
from worker.kernels.fp8_gemm import Fp8Tensor, fp8_linear
from worker.kernels.quant import Int4Weight, QBlocks, QTensor, cat_rows, int4_linear, pack, quantize_rtn, zero_rows

STORED_PIECES = (QTensor, Fp8Tensor)  # checkpoint pieces a linear keeps as the file stores them, packed after loading


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    # empty, not zeros: load_weights fills every parameter (or keeps the quantized pieces instead), and pages that
    # are never written cost no memory
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def linear(x: torch.Tensor, mod: nn.Module) -> torch.Tensor:
    """The module's weight through the fastest kernel it was prepared for: groupwise int4 (quantized), block-FP8
    (Triton), oneDNN's prepacked bfloat16 (CPU: ~2x F.linear, same bits), or F.linear."""
    if mod.qweight is not None:
        if isinstance(mod.qweight, Fp8Tensor):
            return fp8_linear(x, mod.qweight, mod.bias)
        return int4_linear(x, mod.qweight, mod.bias)
    if mod.packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), mod.packed, mod.bias, "none", [], "")
    return F.linear(x, mod.weight, mod.bias)


def _init_linear(mod: nn.Module) -> None:
    mod.packed: torch.Tensor | None = None
    mod.qweight: QBlocks | Int4Weight | Fp8Tensor | None = None
    mod.qparts: list[tuple[int, QTensor | Fp8Tensor]] = []  # stored checkpoint pieces by first row, until packed


def _store(mod: nn.Module, param: nn.Parameter, offset: int, piece) -> None:
    """Write a checkpoint piece into rows offset.. of param. A quantized piece for a linear is only kept (packed
    later), so the dense parameter is never touched and costs no memory; an embedding table stores it dense too."""
    if isinstance(piece, STORED_PIECES):
        mod.qparts.append((offset, piece))
        if hasattr(mod, "qweight"):
            return
        piece = piece.dequantize()
    param.data[offset : offset + piece.shape[0]].copy_(piece)


def _rows(w, start: int, stop: int):
    return w.rows(slice(start, stop)) if isinstance(w, STORED_PIECES) else w[start:stop]


def _cols(w, start: int, stop: int):
    return w.cols(start, stop) if isinstance(w, STORED_PIECES) else w[:, start:stop]


def pack_cpu_linears(model: nn.Module) -> int:
    """Prepack every dense bfloat16 linear weight on CPU for oneDNN, where its bfloat16 linear runs (else F.linear
    multiplies them through torch's generic path). Returns how many were packed."""
    if not onednn_bf16_linear():
        return 0
    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not hasattr(mod, "packed") or w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu":
            continue
        if mod.qweight is not None:
            continue
        mod.packed = torch.ops.mkldnn._reorder_linear_weight(w.data, 1)
        n += 1
    return n


def quantize_linears(model: nn.Module, bits: int | None, dtype: torch.dtype) -> int:
    """Pack each linear for the int4 kernel: from the checkpoint's own quantized pieces where they cover the whole
    weight, else round-to-nearest at `bits` (None: leave dense weights dense). Frees the dense copy. Returns how
    many linears were quantized."""
    n = 0
    for mod in list(model.modules()):
        if not hasattr(mod, "qweight"):
            continue
        tied = getattr(mod, "tied_to", None)
        parts = sorted((tied[0] if tied else mod).qparts, key=lambda p: p[0])
        rows = mod.weight.shape[0]
        if parts and sum(p.shape[0] for _, p in parts) == rows:
            qt = cat_rows([p for _, p in parts])
        elif bits or parts:  # asked for, or a fused weight whose file quantized only some of its parts
            if not tied:
                for offset, p in parts:
                    mod.weight.data[offset : offset + p.shape[0]].copy_(p.dequantize())
            qt = quantize_rtn(mod.weight.data, bits or 8)
        else:
            continue
        mod.qweight = pack(qt, dtype)
        mod.packed = None
        if not tied:  # a tied head's weight is the embedding table, which lookups still need
            mod.weight = nn.Parameter(torch.empty(0, dtype=mod.weight.dtype), requires_grad=False)
        n += 1
    for mod in model.modules():
        if hasattr(mod, "qparts"):
            mod.qparts = []
    return n


def pack_fp8_linears(model: nn.Module, device: torch.device) -> int:
    """Give each linear whose checkpoint pieces are block-FP8 its stacked `Fp8Tensor` on `device`, before the model
    moves there (the dense placeholders are dropped, never copied). Pieces that cannot stack (a fused weight whose
    first part ends inside a block) load dense instead. Returns how many linears keep FP8."""
    n = 0
    for mod in list(model.modules()):
        parts = sorted(getattr(mod, "qparts", ()), key=lambda p: p[0])
        if not parts or not all(isinstance(p, Fp8Tensor) for _, p in parts):
            continue
        mod.qparts = []
        block = parts[0][1].block
        if (
            any(p.shape[0] % block[0] for _, p in parts[:-1])
            or sum(p.shape[0] for _, p in parts) != mod.weight.shape[0]
        ):
            for offset, p in parts:
                mod.weight.data[offset : offset + p.shape[0]].copy_(p.dequantize())
            continue
        codes = torch.cat([p.codes for _, p in parts]).to(device)
        mod.qweight = Fp8Tensor(codes, torch.cat([p.scale for _, p in parts]).to(device), block)
        mod.weight = nn.Parameter(torch.empty(0, dtype=mod.weight.dtype), requires_grad=False)
        n += 1
    return n


def unpack_quantized_linears(model: nn.Module) -> int:
    """Turn each int4-kernel linear back into a dense, oneDNN-prepacked weight holding the very values the kernel
    multiplies by. For long teacher-forced passes (draft-training features), where the int4 kernel costs ~2x dense
    bfloat16 at 512 rows and the labels stay the served model's (on the bf16 kernel; with 8-bit activations the
    dense pass no longer rounds them). Returns how many were unpacked."""
    n = 0
    for mod in model.modules():
        w = getattr(mod, "qweight", None)
        if w is None:
            continue
        eye = torch.eye(w.in_features, dtype=w.dtype)
        dense = int4_linear(eye, w, None).t().contiguous()  # [out, in]: row i of the identity picks column i
        mod.qweight = None
        mod.weight = nn.Parameter(dense, requires_grad=False)  # a tied head's own copy; the table stays as it is
        n += 1
    pack_cpu_linears(model)
    return n


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"shape mismatch for {name}: checkpoint has {tuple(got)}, model expects {tuple(want)}")


def kv_head_range(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """KV heads this rank holds: a slice when tp divides them, one replicated head when tp exceeds them."""
    if num_kv_heads >= tp.size:
        n = num_kv_heads // tp.size
        return tp.rank * n, n
    return tp.rank // (tp.size // num_kv_heads), 1


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along its input dim; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.in_features, self.out_features = tp, in_features, out_features
        self.in_local = in_features // tp.size
        self.weight = _param((out_features, self.in_local), dtype, self._load)
        self.bias = None
        _init_linear(self)

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        _check_shape("row-parallel weight", w.shape, (self.out_features, self.in_features))
        _store(self, param, 0, _cols(w, self.tp.rank * self.in_local, (self.tp.rank + 1) * self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self))


class ReplicatedLinear(nn.Module):
    """A small linear every rank holds whole (EAGLE's fc): no collective, identical inputs give identical outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), dtype, self._load)
        self.bias = _param((out_features,), dtype, self._load) if bias else None
        _init_linear(self)

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        _check_shape("replicated linear", w.shape, tuple(param.shape))
        _store(self, param, 0, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self)


class QKVParallelLinear(nn.Module):
    """Packed q, k, v projections, column-parallel by heads (KV heads replicated when tp > kv heads)."""

    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TPGroup, dtype: torch.dtype
    ):
        super().__init__()
        self.tp, self.hidden, self.head_dim = tp, hidden, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.heads_local = num_heads // tp.size
        self.kv_start, self.kv_local = kv_head_range(num_kv_heads, tp)
        self.q_size = self.heads_local * head_dim
        self.kv_size = self.kv_local * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = _param((out, hidden), dtype, self._load)
        self.bias = _param((out,), dtype, self._load) if bias else None
        _init_linear(self)

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        if shard_id == "q":
            total, start, n, offset = self.num_heads, self.tp.rank * self.heads_local, self.heads_local, 0
        else:
            total, start, n = self.num_kv_heads, self.kv_start, self.kv_local
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        _check_shape(f"{shard_id}_proj", w.shape, (total * d, *param.shape[1:]))
        _store(self, param, offset, _rows(w, start * d, (start + n) * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self)


class MergedColumnParallelLinear(nn.Module):
    """Several projections of the same input packed into one matmul, each split along its output dim."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.in_features, self.out_sizes = tp, in_features, out_sizes
        self.local_sizes = [s // tp.size for s in out_sizes]
        self.weight = _param((sum(self.local_sizes), in_features), dtype, self._load)
        self.bias = None
        _init_linear(self)

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id: int) -> None:
        _check_shape(f"merged shard {shard_id}", w.shape, (self.out_sizes[shard_id], self.in_features))
        n = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        _store(self, param, offset, _rows(w, self.tp.rank * n, (self.tp.rank + 1) * n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self)


def _load_vocab_rows(mod, param: nn.Parameter, w: torch.Tensor) -> None:
    """Keep this rank's range of vocabulary rows, zero-padding the last range."""
    _check_shape("vocabulary matrix", w.shape, (mod.vocab_size, mod.hidden))
    part = _rows(w, mod.start, mod.start + mod.rows)
    if part.shape[0] < mod.rows and not (isinstance(part, QTensor) and hasattr(mod, "qweight")):
        param.data[part.shape[0] :].zero_()
    _store(mod, param, 0, part)
    pad = mod.rows - part.shape[0]
    if pad and isinstance(part, QTensor):
        mod.qparts.append((part.shape[0], zero_rows(pad, mod.hidden, part.bits)))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up its range and the results are summed."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.vocab_size, self.hidden = tp, vocab_size, hidden
        self.rows = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows
        self.weight = _param((self.rows, hidden), dtype, self._load)
        self.qparts: list[tuple[int, QTensor]] = []  # a tied LM head packs these

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        _load_vocab_rows(self, param, w)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocab-split output projection; local logits are gathered so every rank sees the full row."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        tp: TPGroup,
        dtype: torch.dtype,
        tied_to: VocabParallelEmbedding | None = None,
    ):
        super().__init__()
        self.tp, self.vocab_size, self.hidden = tp, vocab_size, hidden
        self.rows = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows
        self.tied_to = [tied_to] if tied_to is not None else None  # a list: the table is not this module's child
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = _param((self.rows, hidden), dtype, lambda p, w, s=None: _load_vocab_rows(self, p, w))
        self.bias = None
        _init_linear(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self)
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden,), dtype, lambda p, w, s=None: p.data.copy_(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # accumulates in float32 whatever the input dtype and rounds once (Hugging Face casts to float32, normalises,
        # casts back, then scales: more kernels, and a second bfloat16 rounding)
        kernels = cpu_kernels.ops(x.device)
        if kernels is not None and x.dtype == self.weight.dtype:
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add and this norm, one fused pass on CPU."""
        kernels = cpu_kernels.ops(x.device)
        if kernels is not None and x.dim() == 2 and x.dtype == delta.dtype == self.weight.dtype:
            return tuple(kernels.add_rms_norm(x, delta, self.weight, self.eps))
        x = x + delta
        return x, self(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    if scaling.get("rope_type") == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, scaling)
    # Llama 3.1 frequency-dependent scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn_inv_freq(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated by
    `factor`, those turning more than beta_fast times are kept, with a linear ramp between."""
    old_len = scaling["original_max_position_embeddings"]

    def dim_turning(turns: float) -> float:  # the dimension whose frequency turns `turns` times over old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast", 32.0)), dim_turning(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv / scaling["factor"] * ramp + inv * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict) -> float:
    """What YaRN multiplies cos and sin by (1 for other kinds)."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if "attention_factor" in scaling:
        return scaling["attention_factor"]
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for these positions, [N, 1, head_dim]: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [N, heads, head_dim] in one pass: q and k heads side by side cost one set of kernels, not two. A table
    narrower than the head (partial rotary) turns the leading dims and passes the rest through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    head, rest = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + _rotate_half(head) * sin, rest], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class GatedMLP(nn.Module):
    """SiLU-gated MLP (Llama's, and each MoE expert's): gate and up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce (MoE sums experts' shares, then reduces once)."""
        gate_up = linear(x, self.gate_up_proj)
        kernels = cpu_kernels.ops(x.device)
        if kernels is not None and gate_up.dim() == 2:
            return linear(kernels.silu_mul(gate_up), self.down_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.tp.all_reduce(self.partial(x))
