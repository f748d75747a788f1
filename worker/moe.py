"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE) with rank-0 routing.

Every rank holds a slice of every expert along the intermediate dimension, so each rank computes partial sums
for the same experts and one all-reduce adds them. That is only right when every rank routes each token to the
same experts with the same weights. Router logits computed on each rank can differ in the last bit (all-reduce
on ROCm is not bit-identical across ranks) and flip a top-k tie, after which the all-reduce adds mismatched
halves and the output is silently wrong. So routing is a rank-0 decision: rank 0 computes it in float32 and
broadcasts the experts and weights of every token (one small broadcast per MoE layer). Recomputing on every
rank with a deterministic tie-break would cost no collective, but it is safe only while the ranks' inputs are
bitwise identical, which is the very assumption that fails on the hardware this engine was built for.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from .dist import TPGroup
from .layers import GatedMLP, ReplicatedLinear
from .model_config import ModelConfig


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, router_noise: float = 0.0,
                 local_routing: bool = False):
        super().__init__()
        self.tp, self.top_k, self.norm_topk = tp, cfg.experts_per_token, cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, dtype)
        self.experts = nn.ModuleList(GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size, tp, dtype)
                                     for _ in range(cfg.num_experts))
        # fault injection (tests): router logits that differ by rank, and the bug of routing on every rank
        self.router_noise, self.local_routing = router_noise * tp.rank, local_routing
        self.noise = torch.Generator(device=tp.device)
        self.noise.manual_seed(2000 + tp.rank)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [n, k], weights [n, k] float32), identical on every rank."""
        n, k = x.shape[0], self.top_k
        packed = torch.empty(n, 2 * k, dtype=torch.float64)
        if self.tp.is_leader or self.local_routing:
            logits = F.linear(x.float(), self.gate.weight.float())
            if self.router_noise:
                logits = logits + self.router_noise * torch.randn(logits.shape, generator=self.noise,
                                                                  device=logits.device)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            packed[:, :k], packed[:, k:] = ids.cpu(), weights.cpu()  # float64 holds both exactly
        if not self.local_routing:
            self.tp.broadcast_tensor(packed)
        ids, weights = packed[:, :k].long(), packed[:, k:].float()
        if self.tp.trace is not None:  # tests: the routing this rank applied, to compare across ranks
            self.tp.trace.append(("moe_routing", [n, k], hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16]))
        return ids.to(x.device), weights.to(x.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.experts[e].partial(x[rows]).float() * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return self.tp.all_reduce(out).to(x.dtype)


def moe_param_map(src: str, dst: str, num_experts: int, mixtral: bool) -> dict:
    """Checkpoint names of one MoE block -> (parameter, shard id): Mixtral's block_sparse_moe w1/w3/w2 or
    Qwen-MoE's mlp gate_proj/up_proj/down_proj."""
    block, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    m = {f"{src}{block}.gate.weight": (f"{dst}mlp.gate.weight", None)}
    for j in range(num_experts):
        e, d = f"{src}{block}.experts.{j}.", f"{dst}mlp.experts.{j}."
        m[f"{e}{gate}.weight"] = (f"{d}gate_up_proj.weight", 0)
        m[f"{e}{up}.weight"] = (f"{d}gate_up_proj.weight", 1)
        m[f"{e}{down}.weight"] = (f"{d}down_proj.weight", None)
    return m
