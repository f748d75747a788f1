"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over a paged cache of latents.

Each token caches one vector per layer: its KV latent `c` (after kv_a_layernorm, kv_lora_rank values) and its
rotated rope key (qk_rope_head_dim values), 576 for the published shapes, shared by every head. Per head h:

    k_h = [W_UK_h c ; k_rope]    v_h = W_UV_h c        (W_UK_h, W_UV_h: head h's rows of kv_b_proj)

Decode and verify rows attend in the latent space: q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_rope, so the
query is absorbed into a 576-wide vector, the cache is read as one shared key/value head, and W_UV_h is applied once
to the weighted latent. Prefill chunks expand K and V per head and run SDPA. Both give the same logits within
float32 rounding (tests/engine/test_mla.py). With the Triton backend every row, prefill included, takes the absorbed
form through worker/kernels/triton_mla.py. Tensor parallelism splits the heads; every rank caches the whole latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.dist import TPGroup
from worker.kernels.fp8_gemm import Fp8Tensor
from worker.kernels.quant import QTensor
from worker.kernels.triton_mla import triton_mla_attend
from worker.model.attention import AttentionMetadata, _row_gather
from worker.model.config import ModelConfig
from worker.model.layers import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    _check_shape,
    _param,
    rope_rows,
    yarn_mscale,
)

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm keep RMSNorm's default in the reference implementations


def column_parallel(in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype):
    return MergedColumnParallelLinear(in_features, [out_features], tp, dtype)


class LatentUpProjection(nn.Module):
    """kv_b_proj, this rank's heads: [heads * (qk_nope + v), kv_lora_rank]. Read as a matrix per head (absorbed into
    the query and output), so it stays dense whatever --quantization says."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.cfg = tp, cfg
        self.heads = cfg.num_heads // tp.size
        self.per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
        self.weight = _param((self.heads * self.per_head, cfg.kv_lora_rank), dtype, self._load)

    def _load(self, param: nn.Parameter, w, shard_id=None) -> None:
        _check_shape("kv_b_proj", w.shape, (self.cfg.num_heads * self.per_head, self.cfg.kv_lora_rank))
        n = self.heads * self.per_head
        mine = slice(self.tp.rank * n, (self.tp.rank + 1) * n)
        if isinstance(w, (QTensor, Fp8Tensor)):  # read per head: kept dense (a head's rows may split a block)
            w = w.dequantize()
        param.data.copy_(w[mine])

    def float32(self) -> torch.Tensor:
        """The weight in float32, where attention computes: converted once, not at every layer of every step."""
        cached = self.__dict__.get("_float32")
        if cached is None or cached[0] != self.weight.data_ptr():  # rebuilt if the weight moves (model.to(device))
            cached = (self.weight.data_ptr(), self.weight.float())
            self._float32 = cached
        return cached[1]

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, qk_nope, kv_lora], W_UV [heads, v, kv_lora]) in float32."""
        w = self.float32().view(self.heads, self.per_head, -1)
        return w[:, : self.cfg.qk_nope_head_dim], w[:, self.cfg.qk_nope_head_dim :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rope over [N, heads, rope_dim]. Interleaved checkpoints pair (x0, x1), (x2, x3), ...: their dims are gathered
    into halves first (q and k alike, so their dot products are those of the interleaved rotation)."""
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return rope_rows(x, cos, sin)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared where the checkpoint extends its context with it."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    s = cfg.rope_scaling_dict
    if s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        if cfg.attention_bias:
            raise ValueError("latent attention with attention_bias is not supported")
        h, heads, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim + cfg.head_dim
        self.heads = heads // tp.size
        self.nope, self.rope_dim, self.v_dim, self.lora = (
            cfg.qk_nope_head_dim,
            cfg.head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, False, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = column_parallel(cfg.q_lora_rank, heads * qk, tp, dtype)
        else:
            self.q_proj = column_parallel(h, heads * qk, tp, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, cfg.kv_lora_rank + cfg.head_dim, False, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(cfg, tp, dtype)
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, h, tp, dtype)
        self.scale = softmax_scale(cfg)
        self.interleaved = cfg.rope_interleave

    @property
    def cache_widths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the K and V caches: one shared latent per token, and no separate V."""
        return (1, self.lora + self.rope_dim), (1, 0)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_rope = q.view(n, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope_dim], dim=-1)
        cos, sin = (t.float() for t in rope)
        q_rope = rotate(q_rope.float(), cos, sin, self.interleaved)
        k_rope = rotate(k_rope.float().unsqueeze(1), cos, sin, self.interleaved)
        latent = torch.cat([self.kv_a_layernorm(c.contiguous()).float().unsqueeze(1), k_rope], dim=-1)
        k_cache.index_copy_(0, meta.slot_mapping, latent.to(k_cache.dtype))
        if meta.paged is not None:  # the Triton backend: every row in the absorbed form, nothing read on the host
            w_uk, w_uv = self.kv_b_proj.split()
            q_lat = torch.einsum("nhd,hdc->nhc", q_nope.float(), w_uk)
            lat = triton_mla_attend(q_lat, q_rope, k_cache, meta.paged, meta.block_size, self.scale)
            out = torch.einsum("nhc,hvc->nhv", lat, w_uv)
            return self.o_proj(out.to(x.dtype).reshape(n, -1))
        out = torch.empty(n, self.heads, self.v_dim, dtype=torch.float32, device=x.device)
        rows = meta.row_index
        if rows is not None:
            every = rows.numel() == n
            pick = (lambda t: t) if every else (lambda t: t.index_select(0, rows))
            o = self._attend_latent(pick(q_nope).float(), pick(q_rope), k_cache, meta)
            out = o if every else out.index_copy_(0, rows, o)
        self._attend_expanded(q_nope.float(), q_rope, k_cache, meta, out)
        return self.o_proj(out.to(x.dtype).reshape(n, -1))

    def _attend_latent(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Rows [R, heads, *] over their own keys, read as one 576-wide latent head. Returns [R, heads, v]."""
        w_uk, w_uv = self.kv_b_proj.split()
        q = torch.cat([torch.einsum("rhd,hdc->rhc", q_nope, w_uk), q_rope], dim=-1)  # [R, heads, lora+rope]
        R, width = meta.row_kv_slots.shape
        index, bias = _row_gather(meta, 1, torch.float32)
        keys = cache.view(-1, cache.shape[-1]).index_select(0, index).view(R, width, -1).float()  # [R, width, 576]
        scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=self.scale)  # [R, heads, width]
        latent = torch.bmm(torch.softmax(scores, dim=-1), keys[..., : self.lora])  # [R, heads, lora]
        return torch.einsum("rhc,hvc->rhv", latent, w_uv)

    def _attend_expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, out
    ) -> None:
        """Long chunks (prefill): each sequence's latents expanded to per-head K and V, one SDPA per sequence."""
        w = self.kv_b_proj.float32()
        for i, start, q_len, kv_len in meta.chunks:
            lat = cache.index_select(0, meta.kv_slots[i, :kv_len])[:, 0].float()  # [kv_len, lora+rope]
            kv = F.linear(lat[:, : self.lora], w).view(kv_len, self.heads, -1)
            k = torch.cat([kv[..., : self.nope], lat[:, None, self.lora :].expand(-1, self.heads, -1)], dim=-1)
            v = kv[..., self.nope :]
            q = torch.cat([q_nope[start : start + q_len], q_rope[start : start + q_len]], dim=-1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=meta.mask[i : i + 1, :, :q_len, :kv_len],
                scale=self.scale,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)


def mla_param_map(src: str, dst: str, cfg: ModelConfig) -> dict[str, tuple[str, object]]:
    """Checkpoint names of one latent-attention block -> (parameter, shard id)."""
    names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    names += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
    shard = {"q_b_proj": 0, "q_proj": 0}
    return {f"{src}self_attn.{n}.weight": (f"{dst}self_attn.{n}.weight", shard.get(n)) for n in names}
