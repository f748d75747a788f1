"""The checkpoint's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5+ `num_nextn_predict_layers`) as the draft.

Stored after the decoder layers as `model.layers.{num_hidden_layers}`: for the token at position p+1 and the target's
final hidden state at p,

    x = eh_proj([enorm(embed(token)) ; hnorm(hidden)])  ->  decoder layer (latent attention, MoE)  ->  shared_head.norm

and the target's LM head gives the draft's logits. The embedding and LM head are the target's (the checkpoint's copies
under the layer, `embed_tokens` and `shared_head.head`, are the same tensors and are not loaded). It drafts chains and
trees exactly like an EAGLE-1 head: deeper levels feed the layer its own normed output, with its own KV cache.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.model.attention import AttentionMetadata
from worker.model.causal_lm import CausalLM, DecoderLayer, decoder_param_map, rope_dtype
from worker.model.files import ModelLoadError, ModelSource
from worker.model.layers import ReplicatedLinear, RMSNorm, pack_fp8_linears
from worker.model.moe import SparseMoE
from worker.model.weights import checkpoint_names, iter_checkpoint, load_weights


class MTPDraft(nn.Module):
    kind = "mtp"
    dcfg = None  # no EAGLE-3 aux layers, no draft vocabulary

    def __init__(self, target: CausalLM, tp: TPGroup, dtype: torch.dtype, moe: SparseMoE | None):
        super().__init__()
        cfg = target.cfg
        self._target = [target]  # a reference, not a submodule: its weights belong to the target
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, dtype)
        self.layer = DecoderLayer(cfg, tp, dtype, moe=moe)
        self.shared_head_norm = RMSNorm(h, eps, dtype)

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    @property
    def attention(self) -> nn.Module:
        return self.layer.self_attn

    @property
    def stored_width(self) -> int:
        return self.target.cfg.hidden_size

    def stored(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return hidden  # the target's final normed hidden state

    def fuse(self, stored: torch.Tensor) -> torch.Tensor:
        return stored

    def forward(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        embeds = self.target.embed_tokens(ids)
        rope = self.target.rope.table(positions, rope_dtype(embeds))
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feats.to(embeds.dtype))], dim=-1))
        return self.shared_head_norm(self.layer(x, rope, kv[0], kv[1], meta))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(out).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def param_map(self, moe: bool) -> dict[str, tuple[str, object]]:
        m = {f"{n}.weight": (f"{n}.weight", None) for n in ("enorm", "hnorm", "eh_proj")}
        m["shared_head.norm.weight"] = ("shared_head_norm.weight", None)
        return m | decoder_param_map("", "layer.", self.target.cfg, moe)


def load_mtp_draft(config: EngineConfig, source: ModelSource, target: CausalLM, tp: TPGroup, dtype) -> MTPDraft:
    cfg = target.cfg
    if not cfg.mtp_layers:
        raise ModelLoadError(
            f"{source.path} has no multi-token-prediction layer (num_nextn_predict_layers is 0), so speculative "
            f"decoding has no draft: pass an EAGLE head with --speculative-draft-model-path, or turn speculation off "
            f"with --speculative-algorithm NONE"
        )
    prefix = f"model.layers.{cfg.num_layers}."
    names = {n[len(prefix) :] for n in checkpoint_names(source) if n.startswith(prefix)}
    if "eh_proj.weight" not in names:
        raise ModelLoadError(f"{source.path} declares an MTP layer but holds no {prefix}eh_proj.weight")
    moe = any(n.startswith("mlp.experts.") for n in names)
    router = SparseMoE(cfg, tp, dtype, config.debug_rank_router_noise, config.debug_skip_decision_broadcast)
    head = MTPDraft(target, tp, dtype, router if moe else None)
    method = "fp8" if target.weights_method == "fp8" else "none"  # int4/int8 drafts: speculative/worker.py
    tensors = iter_checkpoint(source, cfg, False, method, only=lambda n: n.startswith(prefix))
    load_weights(
        head,
        head.param_map(moe),
        ((n[len(prefix) :], w) for n, w in tensors),
        ignore=(r"embed_tokens\.weight", r"shared_head\.head\.weight", re.escape("rotary_emb.inv_freq")),
    )
    if method == "fp8":
        pack_fp8_linears(head, tp.device)
    return head.to(tp.device).eval()
