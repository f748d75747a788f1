"""Tensor-parallel building blocks. Each parameter carries a weight_loader that takes the full
checkpoint tensor and keeps only this rank's shard, so no rank ever holds another's weights."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .dist import TPGroup


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """F.linear, or oneDNN's prepacked kernel when the weight was packed (CPU bfloat16: ~2x faster, same bits)."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_cpu_linears(model: nn.Module) -> int:
    """Prepack every linear weight for oneDNN on CPU in bfloat16. Returns how many were packed."""
    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not hasattr(mod, "packed") or w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu":
            continue
        mod.packed = torch.ops.mkldnn._reorder_linear_weight(w.data, 1)
        n += 1
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
        self.packed: torch.Tensor | None = None

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        _check_shape("row-parallel weight", w.shape, (self.out_features, self.in_features))
        param.data.copy_(w[:, self.tp.rank * self.in_local : (self.tp.rank + 1) * self.in_local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight, None, self.packed))


class ReplicatedLinear(nn.Module):
    """A small linear every rank holds whole (EAGLE's fc): no collective, identical inputs give identical outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), dtype, self._load)
        self.bias = _param((out_features,), dtype, self._load) if bias else None
        self.packed: torch.Tensor | None = None

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        _check_shape("replicated linear", w.shape, tuple(param.shape))
        param.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class QKVParallelLinear(nn.Module):
    """Packed q, k, v projections, column-parallel by heads (KV heads replicated when tp > kv heads)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype):
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
        self.packed: torch.Tensor | None = None

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        if shard_id == "q":
            total, start, n, offset = self.num_heads, self.tp.rank * self.heads_local, self.heads_local, 0
        else:
            total, start, n = self.num_kv_heads, self.kv_start, self.kv_local
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        _check_shape(f"{shard_id}_proj", w.shape, (total * d, *param.shape[1:]))
        param.data[offset : offset + n * d].copy_(w[start * d : (start + n) * d])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class MergedColumnParallelLinear(nn.Module):
    """Several projections of the same input packed into one matmul, each split along its output dim."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.in_features, self.out_sizes = tp, in_features, out_sizes
        self.local_sizes = [s // tp.size for s in out_sizes]
        self.weight = _param((sum(self.local_sizes), in_features), dtype, self._load)
        self.packed: torch.Tensor | None = None

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id: int) -> None:
        _check_shape(f"merged shard {shard_id}", w.shape, (self.out_sizes[shard_id], self.in_features))
        n = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        param.data[offset : offset + n].copy_(w[self.tp.rank * n : (self.tp.rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.packed)


def _load_vocab_rows(mod, param: nn.Parameter, w: torch.Tensor) -> None:
    """Keep this rank's range of vocabulary rows, zero-padding the last range."""
    _check_shape("vocabulary matrix", w.shape, (mod.vocab_size, mod.hidden))
    part = w[mod.start : mod.start + mod.rows]
    param.data.zero_()
    param.data[: part.shape[0]].copy_(part)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up its range and the results are summed."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.vocab_size, self.hidden = tp, vocab_size, hidden
        self.rows = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows
        self.weight = _param((self.rows, hidden), dtype, self._load)

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

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp, self.vocab_size, self.hidden = tp, vocab_size, hidden
        self.rows = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = _param((self.rows, hidden), dtype, lambda p, w, s=None: _load_vocab_rows(self, p, w))
        self.packed: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed)
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden,), dtype, lambda p, w, s=None: p.data.copy_(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in float32 then cast, as Hugging Face does; one fused kernel instead of six small ones
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, float]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
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


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, float]):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for these positions, [N, 1, head_dim]: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k: [N, heads, head_dim]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
