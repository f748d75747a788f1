"""Llama-family decoder (Llama, Mistral, Qwen2/3, and the MoE variants in moe.py) built from tensor-parallel layers."""

from __future__ import annotations

import torch
from torch import nn

from worker.dist import TPGroup
from worker.kernels import cpu as cpu_kernels
from worker.kernels.quant import QBlocks
from worker.model.attention import AttentionMetadata, attend, attend_rotated
from worker.model.config import ModelConfig
from worker.model.layers import (
    GatedMLP,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_rows,
)
from worker.model.mla import MLAttention, mla_param_map
from worker.model.moe import SparseMoE, moe_param_map


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, in_features: int | None = None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            in_features or cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, tp, dtype
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp, dtype)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        if cfg.qk_norm:  # replicated: one weight of head_dim shared by every head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    @property
    def cache_widths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of this rank's K and V caches."""
        return (self.qkv_proj.kv_local, self.head_dim), (self.qkv_proj.kv_local, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        p = self.qkv_proj
        n, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : p.q_size + p.kv_size].view(n, -1, d)
        if hasattr(self, "q_norm"):
            q, k = qk.split([p.q_size // d, p.kv_size // d], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        v = qkv[:, p.q_size + p.kv_size :].view(n, -1, d)
        kernels = cpu_kernels.ops(x.device)
        if kernels is not None and meta.paged is None:  # fused: rotary and the cache write, then attention (f32 rope)
            q, k = qk.split([p.q_size // d, p.kv_size // d], dim=1)
            q = kernels.rope_write_cache(
                q, k, v, rope[0].view(n, -1), rope[1].view(n, -1), k_cache, v_cache, meta.slot_mapping
            )
            out = attend_rotated(kernels, q, k_cache, v_cache, meta, self.scale, x.dtype)
        else:
            qk = rope_rows(qk, *(t.to(qk.dtype) for t in rope))  # q and k heads rotated together
            q, k = qk.split([p.q_size // d, p.kv_size // d], dim=1)
            out = attend(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, -1))


def rope_dtype(x: torch.Tensor) -> torch.dtype:
    """The fused CPU kernels rotate in float32 from a float32 table; the eager path rotates in the model dtype."""
    return torch.float32 if cpu_kernels.ops(x.device) is not None else x.dtype


def MLP(cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> GatedMLP:  # noqa: N802 - reads as the module it makes
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype)


FUSED_LAYERS = True  # bench/step.py turns this off to time the ops of a layer one kind at a time


def fused_layer(layer: nn.Module, x: torch.Tensor, meta: AttentionMetadata):
    """(cpu_kernels, the layer's weights) where the layer runs as one call this step (every row attends row-wise:
    decode, verify, short chunks), else None."""
    rows, kernels = meta.row_index, cpu_kernels.ops(x.device)
    if not (
        FUSED_LAYERS and kernels is not None and meta.paged is None and rows is not None and rows.numel() == x.shape[0]
    ):
        return None
    weights = fused_weights(layer, kernels, x.dtype)
    return None if weights is None else (kernels, weights)


def fused_stack(model: nn.Module, x: torch.Tensor, meta: AttentionMetadata):
    """(cpu_kernels, every layer's weights) where the whole stack runs as one call this step (each layer would run
    as one fused call: `fused_layer`), else None."""
    first = fused_layer(model.layers[0], x, meta)
    if first is None:
        return None
    weights = [first[1]] + [fused_weights(layer, first[0], x.dtype) for layer in model.layers[1:]]
    return None if any(w is None for w in weights) else (first[0], weights)


def fused_weights(layer: nn.Module, kernels, dtype: torch.dtype):
    """A layer's weights for cpu_kernels' one-call layer, built on first use (again if a weight is swapped), or None
    where the layer is not a quantized Llama-style layer on one rank (`input_layernorm`, `self_attn`,
    `post_attention_layernorm`, a gated `mlp`)."""
    if not isinstance(layer.self_attn, Attention):  # latent attention runs through torch (worker/model/mla.py)
        return None
    cached = layer.__dict__.get("_fused")  # (its linears, their weights then, LayerWeights): a hot path, plain reads
    if cached is not None and all(getattr(m, "qweight", None) is w for m, w in zip(cached[0], cached[1])):
        return cached[2]
    attn, mlp = layer.self_attn, layer.mlp
    mods = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    key = tuple(getattr(m, "qweight", None) for m in mods)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    usable = (
        isinstance(mlp, GatedMLP)
        and attn.qkv_proj.tp.size == 1
        and not hasattr(attn, "q_norm")
        and all(isinstance(n, RMSNorm) for n in norms)
        and all(isinstance(w, QBlocks) and w.kernel is kernels.qlinear for w in key)
        and all(m.bias is None for m in mods)
        and norms[0].weight.dtype == dtype == norms[1].weight.dtype
    )
    fused = None
    if usable:
        p = attn.qkv_proj
        qw = [kernels.QWeight(w.codes, w.scale_offset, w.bits, w.out_features, w.variant) for w in key]
        fused = kernels.LayerWeights(
            norms[0].weight,
            norms[1].weight,
            norms[0].eps,
            *qw,
            p.q_size // attn.head_dim,
            p.kv_size // attn.head_dim,
            attn.head_dim,
            attn.scale,
        )
    layer._fused = (mods, key, fused)
    return fused


def fused_args(
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor | list[torch.Tensor],
    v_cache: torch.Tensor | list[torch.Tensor],
    meta: AttentionMetadata,
) -> tuple:
    """The per-step arguments of cpu_kernels.decoder_layer / layer_after_norm after the weights and inputs (one
    layer's caches), or of decoder_stack (every layer's)."""
    n = x.shape[0]
    return (
        rope[0].view(n, -1),
        rope[1].view(n, -1),
        k_cache,
        v_cache,
        meta.slot_mapping,
        meta.row_kv_slots,
        meta.row_counts,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, input_norm: bool = True, moe: SparseMoE | None = None
    ):
        super().__init__()
        # EAGLE-1/2 draft layers have no input norm: their input is already a fused, normed feature
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if input_norm else nn.Identity()
        self.self_attn = MLAttention(cfg, tp, dtype) if cfg.mla else Attention(cfg, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = moe if moe is not None else MLP(cfg, tp, dtype)

    def forward(self, x, rope, k_cache, v_cache, meta):
        fused = fused_layer(self, x, meta)
        if fused is not None:  # a decode or verify step on one rank: the whole layer in one kernel call
            kernels, weights = fused
            return kernels.decoder_layer(weights, x, *fused_args(x, rope, k_cache, v_cache, meta))
        delta = self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta)
        x, h = self.post_attention_layernorm.after_add(x, delta)
        return x + self.mlp(h)


class CausalLM(nn.Module):
    """forward() returns the final-normed hidden states plus the residual stream after each of `aux_layers`
    (what EAGLE-3 fuses); compute_logits() applies the vocab-parallel LM head."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        max_positions: int,
        aux_layers: tuple[int, ...] = (),
        router_noise: float = 0.0,
        local_routing: bool = False,
    ):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.weights_method = "none"  # how the loader stored the linears (worker/model/loader.py)
        self.aux_layers = set(aux_layers)
        self.rope = RotaryEmbedding(cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling_dict)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                tp,
                dtype,
                moe=SparseMoE(cfg, tp, dtype, router_noise, local_routing) if i in cfg.moe_layers else None,
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tp, dtype, self.embed_tokens if cfg.tie_word_embeddings else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embed_tokens(input_ids)
        rope = self.rope.table(positions, rope_dtype(x))
        stack = fused_stack(self, x, meta)
        if stack is not None:  # a decode or verify step on one rank: every layer in one kernel call
            kernels, weights = stack
            caches = [k for k, _ in kv], [v for _, v in kv]
            x, *aux = kernels.decoder_stack(weights, x, *fused_args(x, rope, *caches, meta), sorted(self.aux_layers))
            return self.norm(x), aux
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv[i][0], kv[i][1], meta)
            if i in self.aux_layers:
                aux.append(x)  # the residual stream after layer i (EAGLE-3's low/mid/high features)
        return self.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def param_map(self) -> dict[str, tuple[str, object]]:
        """Checkpoint (Hugging Face) name -> (this module's parameter name, shard id)."""
        m: dict[str, tuple[str, object]] = {
            "model.embed_tokens.weight": ("embed_tokens.weight", None),
            "model.norm.weight": ("norm.weight", None),
        }
        if not self.cfg.tie_word_embeddings:
            m["lm_head.weight"] = ("lm_head.weight", None)
        for i in range(self.cfg.num_layers):
            c, src, dst = self.cfg, f"model.layers.{i}.", f"layers.{i}."
            m |= decoder_param_map(src, dst, c, moe=i in c.moe_layers)
        return m


def decoder_param_map(src: str, dst: str, cfg: ModelConfig, moe: bool) -> dict[str, tuple[str, object]]:
    """One target decoder layer (an MTP layer's too): its attention, norms and dense or sparse MLP."""
    m = layer_param_map(src, dst, cfg.attention_bias, qk_norm=cfg.qk_norm, mlp=not moe, attention=not cfg.mla)
    if cfg.mla:
        m |= mla_param_map(src, dst, cfg)
    return m | (moe_param_map(src, dst, cfg) if moe else {})


def layer_param_map(
    src: str,
    dst: str,
    qkv_bias: bool = False,
    input_norm: bool = True,
    qk_norm: bool = False,
    mlp: bool = True,
    attention: bool = True,
) -> dict:
    """Checkpoint names of one decoder layer -> (packed parameter, shard id), for targets and draft heads."""
    m: dict[str, tuple[str, object]] = {}
    for proj in ("q", "k", "v") if attention else ():
        m[f"{src}self_attn.{proj}_proj.weight"] = (f"{dst}self_attn.qkv_proj.weight", proj)
        if qkv_bias:
            m[f"{src}self_attn.{proj}_proj.bias"] = (f"{dst}self_attn.qkv_proj.bias", proj)
    if attention:
        m[f"{src}self_attn.o_proj.weight"] = (f"{dst}self_attn.o_proj.weight", None)
    if qk_norm:
        for norm in ("q_norm", "k_norm"):
            m[f"{src}self_attn.{norm}.weight"] = (f"{dst}self_attn.{norm}.weight", None)
    if mlp:
        m[f"{src}mlp.gate_proj.weight"] = (f"{dst}mlp.gate_up_proj.weight", 0)
        m[f"{src}mlp.up_proj.weight"] = (f"{dst}mlp.gate_up_proj.weight", 1)
        m[f"{src}mlp.down_proj.weight"] = (f"{dst}mlp.down_proj.weight", None)
    if input_norm:
        m[f"{src}input_layernorm.weight"] = (f"{dst}input_layernorm.weight", None)
    m[f"{src}post_attention_layernorm.weight"] = (f"{dst}post_attention_layernorm.weight", None)
    return m
