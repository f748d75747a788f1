"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4 MoE) with rank-0 routing.

Each rank holds a slice of every expert and one all-reduce adds the partial sums, right only if all ranks route a
token alike. Router logits can differ by a bit across ranks (ROCm's all-reduce) and flip a top-k tie, so rank 0
routes in float32 and broadcasts the choice (one device broadcast per MoE layer: no host sync, so GPU steps can be
captured). With the Triton backend the experts run as two fused grouped GEMMs (worker/kernels/fused_moe.py); on the
CPU path each expert used takes its own rows.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from worker.dist import TPGroup
from worker.kernels.fp8_gemm import Fp8Tensor
from worker.kernels.fused_moe import ExpertWeights, fused_experts
from worker.model.config import ModelConfig
from worker.model.layers import GatedMLP, _check_shape, _param


class Router(nn.Module):
    """The gate: float32 weights (routing is computed in float32 whatever the model's dtype), the per-expert
    score-correction bias of grouped sigmoid routing, and Qwen2-MoE's shared-expert gate. Not a linear the int4 path
    packs: routing stays exact."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()

        def copy(p: torch.Tensor, w: torch.Tensor, shard_id=None) -> None:  # checkpoint dtype -> float32
            _check_shape("router weight", w.shape, tuple(p.shape))
            p.data.copy_(w)

        self.weight = _param((cfg.num_experts, cfg.hidden_size), torch.float32, copy)
        if cfg.routing == "grouped_sigmoid":
            self.e_score_correction_bias = _param((cfg.num_experts,), torch.float32, copy)
        if cfg.shared_expert_gate:
            self.shared_expert_weight = _param((1, cfg.hidden_size), torch.float32, copy)


def top_k_routing(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(weights [n, k], expert ids [n, k]) from float32 router logits [n, experts]."""
    k = cfg.experts_per_token
    if cfg.routing == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    # grouped sigmoid (DeepSeek-V3, GLM-4 MoE): the bias steers the choice only; weights are the plain scores
    scores = logits.sigmoid()
    choice = scores + bias
    n, g = logits.shape[0], cfg.expert_groups
    group_scores = choice.view(n, g, -1).topk(min(2, cfg.num_experts // g), dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, cfg.topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(cfg.num_experts // g, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class SparseMoE(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, router_noise: float = 0.0, local_routing: bool = False
    ):
        super().__init__()
        self.tp, self.cfg = tp, cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size, tp, dtype) for _ in range(cfg.num_experts)
        )
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, tp, dtype)
        # fault injection (tests): router logits that differ by rank, and the bug of routing on every rank
        self.router_noise, self.local_routing = router_noise * tp.rank, local_routing
        self.noise = torch.Generator(device=tp.device)
        self.noise.manual_seed(2000 + tp.rank)
        self.fused: tuple[ExpertWeights, ExpertWeights] | None = None  # pack_fused(): the Triton backend's layout

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(expert ids [n, k], weights [n, k] float32, shared-expert scale [n, 1] or None), identical on every
        rank. Packed in float32, which holds expert ids and float32 weights exactly."""
        n, k = x.shape[0], self.cfg.experts_per_token
        gated = self.cfg.shared_expert_gate
        packed = torch.empty(n, 2 * k + gated, dtype=torch.float32, device=x.device)
        if self.tp.is_leader or self.local_routing:
            xf = x.float()
            logits = F.linear(xf, self.gate.weight)
            if self.router_noise:
                logits = logits + self.router_noise * torch.randn(
                    logits.shape, generator=self.noise, device=logits.device
                )
            weights, ids = top_k_routing(logits, self.cfg, getattr(self.gate, "e_score_correction_bias", None))
            packed[:, :k], packed[:, k : 2 * k] = ids, weights
            if gated:
                packed[:, 2 * k :] = torch.sigmoid(F.linear(xf, self.gate.shared_expert_weight))
        if not self.local_routing:
            self.tp.broadcast_device(packed)
        ids, weights = packed[:, :k].long(), packed[:, k : 2 * k]
        if self.tp.trace is not None:  # tests: the routing this rank applied, to compare across ranks
            digest = hashlib.sha1(ids.cpu().numpy().tobytes()).hexdigest()[:16]
            self.tp.trace.append(("moe_routing", [n, k], digest))
        return ids, weights, packed[:, 2 * k :] if gated else None

    def pack_fused(self) -> bool:
        """Stack the experts' weights for the fused kernels (the Triton backend) and free the per-expert copies.
        Dense and block-FP8 experts stack; int4/int8 ones keep the per-expert path. Returns whether it packed."""
        ups = [e.gate_up_proj for e in self.experts]
        downs = [e.down_proj for e in self.experts]
        up, down = _stack(ups), _stack(downs)
        if up is None or down is None:
            return False
        self.fused = (up, down)
        for mod in ups + downs:  # the stacked copy is the only one now
            mod.weight = nn.Parameter(torch.empty(0, dtype=mod.weight.dtype, device=mod.weight.device), False)
            mod.qweight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights, shared_scale = self.route(x)
        if self.fused is not None:
            out = fused_experts(x, ids, weights, *self.fused)
        else:
            out = torch.zeros_like(x, dtype=torch.float32)
            for e in torch.unique(ids).tolist():
                rows, slot = torch.nonzero(ids == e, as_tuple=True)
                y = self.experts[e].partial(x[rows]).float() * weights[rows, slot, None]
                out.index_add_(0, rows, y)
        if hasattr(self, "shared_experts"):  # its partial sum joins the routed ones: still one all-reduce
            y = self.shared_experts.partial(x).float()
            out += y * shared_scale if shared_scale is not None else y
        return self.tp.all_reduce(out).to(x.dtype)


def _stack(mods: list[nn.Module]) -> ExpertWeights | None:
    """One weight per expert -> [experts, out, in]: dense, or block-FP8 codes with their scales (square blocks)."""
    q = [m.qweight for m in mods]
    if all(w is None for w in q) and all(m.packed is None for m in mods):
        return ExpertWeights(torch.stack([m.weight.data for m in mods]))
    if all(isinstance(w, Fp8Tensor) and w.block[0] == w.block[1] for w in q):
        return ExpertWeights(torch.stack([w.codes for w in q]), torch.stack([w.scale for w in q]), q[0].block[0])
    return None


def pack_fused_moe(model: nn.Module) -> int:
    """Every MoE layer of the model onto the fused kernels where its weights allow; returns how many."""
    return sum(m.pack_fused() for m in model.modules() if isinstance(m, SparseMoE))


def moe_param_map(src: str, dst: str, cfg: ModelConfig) -> dict:
    """Checkpoint names of one MoE block -> (parameter, shard id): Mixtral's block_sparse_moe w1/w3/w2, or the
    mlp gate_proj/up_proj/down_proj of Qwen-MoE and GLM-4 MoE (with their shared experts, Qwen2-MoE's shared-expert
    gate and GLM's score bias)."""
    mixtral = cfg.architecture == "mixtral"
    block, (gate, up, down) = (
        ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    m = {f"{src}{block}.gate.weight": (f"{dst}mlp.gate.weight", None)}
    if cfg.routing == "grouped_sigmoid":
        m[f"{src}{block}.gate.e_score_correction_bias"] = (f"{dst}mlp.gate.e_score_correction_bias", None)
    experts = [(f"{src}{block}.experts.{j}.", f"{dst}mlp.experts.{j}.") for j in range(cfg.num_experts)]
    if cfg.shared_expert_gate:
        m[f"{src}{block}.shared_expert_gate.weight"] = (f"{dst}mlp.gate.shared_expert_weight", None)
    if cfg.shared_expert_intermediate_size:  # Qwen2-MoE names it in the singular
        shared = "shared_expert." if cfg.architecture == "qwen2_moe" else "shared_experts."
        experts.append((f"{src}{block}.{shared}", f"{dst}mlp.shared_experts."))
    for e, d in experts:
        m[f"{e}{gate}.weight"] = (f"{d}gate_up_proj.weight", 0)
        m[f"{e}{up}.weight"] = (f"{d}gate_up_proj.weight", 1)
        m[f"{e}{down}.weight"] = (f"{d}down_proj.weight", None)
    return m
