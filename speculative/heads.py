"""EAGLE draft heads: EAGLE-1/2 (fc over [token embedding; target feature], one decoder layer, the target's LM
head) and EAGLE-3 (three fused target layers, a 2h-input layer, its own reduced-vocabulary LM head with d2t).

Loads SafeAILab EAGLE and EAGLE-3 checkpoints and eaglegate's own (the EAGLE layout); the layer is sharded across
TP ranks exactly like the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from worker.dist import TPGroup
from worker.model.attention import AttentionMetadata
from worker.model.causal_lm import (
    MLP,
    Attention,
    CausalLM,
    DecoderLayer,
    fused_args,
    fused_layer,
    layer_param_map,
    rope_dtype,
)
from worker.model.config import ModelConfig
from worker.model.files import ModelLoadError
from worker.model.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, RotaryEmbedding
from worker.model.weights import load_weights

SHIPPED_HEADS = Path(__file__).parent / "heads"


@dataclass(frozen=True)
class DraftConfig:
    kind: str  # "eagle" (EAGLE-1/2) | "eagle3"
    layer: ModelConfig  # shapes of the draft decoder layer
    fc_bias: bool
    input_norm: bool  # EAGLE-1/2 layer 0 has none
    draft_vocab_size: int | None  # EAGLE-3's reduced vocabulary, or an EAGLE head's FR-Spec subset
    aux_layers: tuple[int, ...]  # EAGLE-3: target layers whose outputs are fused


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high target layers when a head does not name them."""
    return (2, num_layers // 2, num_layers - 3)


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.exists():
            return torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot read draft head weights in {folder} (truncated or corrupt?): {e}") from e
    raise ModelLoadError(f"draft head folder {folder} has neither model.safetensors nor pytorch_model.bin")


def read_draft(path: str | Path, target_cfg: ModelConfig) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"draft head folder {folder} has no config.json")
    raw = json.loads((folder / "config.json").read_text())
    state = _read_state_dict(folder)
    kind = "eagle3" if any(k.startswith("midlayer.") for k in state) else "eagle"
    if "fc.weight" not in state:
        raise ModelLoadError(f"{folder} is not an EAGLE head: no fc.weight (keys: {sorted(state)[:5]}...)")
    hidden = raw.get("hidden_size", target_cfg.hidden_size)
    if hidden != target_cfg.hidden_size:
        raise ModelLoadError(f"draft head hidden size {hidden} does not match the target's {target_cfg.hidden_size}")
    fc_in = state["fc.weight"].shape[1]
    want = 3 * hidden if kind == "eagle3" else 2 * hidden
    if fc_in != want:
        raise ModelLoadError(f"draft head fc.weight takes {fc_in} inputs; {kind} with hidden {hidden} needs {want}")
    heads = raw.get("num_attention_heads", target_cfg.num_heads)
    layer = ModelConfig(
        architecture="llama",
        vocab_size=raw.get("vocab_size", target_cfg.vocab_size),
        hidden_size=hidden,
        intermediate_size=raw.get("intermediate_size", target_cfg.intermediate_size),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", target_cfg.rms_norm_eps),
        rope_theta=float(raw.get("rope_theta", target_cfg.rope_theta)),
        max_position_embeddings=target_cfg.max_position_embeddings,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_scaling=target_cfg.rope_scaling,
    )
    aux: tuple[int, ...] = ()
    if kind == "eagle3":
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(ids) if ids else default_aux_layers(target_cfg.num_layers)
    if kind == "eagle3":
        draft_vocab = state["lm_head.weight"].shape[0]
    else:
        draft_vocab = state["draft_vocab"].numel() if "draft_vocab" in state else None
    return DraftConfig(
        kind, layer, "fc.bias" in state, "layers.0.input_layernorm.weight" in state, draft_vocab, aux
    ), state


def resolve_draft_path(path: str | None) -> Path:
    if path is None:
        raise ModelLoadError("speculative decoding needs --speculative-draft-model-path")
    p = Path(path).expanduser()
    if not p.exists() and (SHIPPED_HEADS / path).exists():
        p = SHIPPED_HEADS / path
    if not p.exists():
        raise ModelLoadError(f"draft head path {path!r} does not exist")
    return p


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer: attention over [norm(embedding) ; norm(feature)], residual on the feature."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, tp, dtype, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, tp, dtype)

    def forward(self, embeds, feats, rope, k_cache, v_cache, meta):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feats)], dim=-1)
        fused = fused_layer(self, feats, meta)
        if fused is not None:  # the rest of the layer in one call, as the target's layers (worker/model/causal_lm.py)
            kernels, weights = fused
            return kernels.layer_after_norm(weights, feats, x, *fused_args(feats, rope, k_cache, v_cache, meta))
        h, normed = self.post_attention_layernorm.after_add(feats, self.self_attn(x, rope, k_cache, v_cache, meta))
        return h + self.mlp(normed)


class DraftHead(nn.Module):
    def __init__(self, dcfg: DraftConfig, target: CausalLM, tp: TPGroup, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.dcfg, self.kind = dcfg, dcfg.kind
        self._target = [target]  # a reference, not a submodule: its weights belong to the target
        cfg = dcfg.layer
        h = cfg.hidden_size
        self.rope = RotaryEmbedding(cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling_dict)
        if self.kind == "eagle":
            self.fc = ReplicatedLinear(2 * h, h, dcfg.fc_bias, dtype)
            self.layer = DecoderLayer(cfg, tp, dtype, input_norm=dcfg.input_norm)
        else:
            self.fc = ReplicatedLinear(3 * h, h, False, dtype)
            self.midlayer = Eagle3Layer(cfg, tp, dtype)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(dcfg.draft_vocab_size, h, tp, dtype)
            self.register_buffer("d2t", torch.zeros(dcfg.draft_vocab_size, dtype=torch.long), persistent=False)
        self.vocab_subset: torch.Tensor | None = None  # FR-Spec: draft only among these target ids
        self.subset_head: ReplicatedLinear | None = None

    @property
    def attention(self) -> nn.Module:
        return (self.layer if self.kind == "eagle" else self.midlayer).self_attn

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    @property
    def stored_width(self) -> int:
        return self.dcfg.layer.hidden_size * (1 if self.kind == "eagle" else 3)

    def stored(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """What is kept per target position for the draft: the final hidden (EAGLE) or the low, middle and high
        residual streams side by side (EAGLE-3). `fuse` applies EAGLE-3's fc only to the rows a draft reads, so a
        step that does not draft (a large batch, a plain step rank 0 chose) pays a copy, not a matmul."""
        return hidden if self.kind == "eagle" else torch.cat(aux, dim=-1)

    def fuse(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows -> the feature the draft layer reads."""
        return stored if self.kind == "eagle" else self.fc(stored)

    def forward(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        embeds = self.target.embed_tokens(ids)
        rope = self.rope.table(positions, rope_dtype(embeds))
        feats = feats.to(embeds.dtype)
        if self.kind == "eagle":
            return self.layer(self.fc(torch.cat([embeds, feats], dim=-1)), rope, kv[0], kv[1], meta)
        return self.midlayer(embeds, feats, rope, kv[0], kv[1], meta)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target vocabulary (EAGLE-3: reduced vocabulary, see to_target_ids)."""
        if self.kind == "eagle":
            if self.subset_head is not None:
                return self.subset_head(out).float()  # FR-Spec: a fraction of the LM head's rows
            logits = self.target.compute_logits(out).float()
            return logits if self.vocab_subset is None else logits.index_select(-1, self.vocab_subset)
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "eagle":
            return draft_ids if self.vocab_subset is None else self.vocab_subset[draft_ids]
        return draft_ids + self.d2t[draft_ids]

    def use_vocab_subset(self, ids: torch.Tensor) -> None:
        """Restrict drafting to `ids`. At tp=1 the LM head rows are copied out so drafting skips the rest."""
        self.vocab_subset = ids.long().to(self.target.lm_head.weight.device)
        if self.target.tp.size == 1 and self.target.lm_head.qweight is None:  # a quantized head keeps no dense rows
            w = self.target.lm_head.weight.detach()
            self.subset_head = ReplicatedLinear(w.shape[1], len(ids), False, w.dtype).to(w.device)
            self.subset_head.weight.data.copy_(w.index_select(0, self.vocab_subset))

    def param_map(self) -> dict[str, tuple[str, object]]:
        m: dict[str, tuple[str, object]] = {"fc.weight": ("fc.weight", None)}
        if self.kind == "eagle":
            if self.dcfg.fc_bias:
                m["fc.bias"] = ("fc.bias", None)
            return m | layer_param_map("layers.0.", "layer.", input_norm=self.dcfg.input_norm)
        m |= {
            "norm.weight": ("norm.weight", None),
            "lm_head.weight": ("lm_head.weight", None),
            "midlayer.hidden_norm.weight": ("midlayer.hidden_norm.weight", None),
        }
        return m | layer_param_map("midlayer.", "midlayer.")


def load_draft_head(
    path: str | Path, target: CausalLM, tp: TPGroup, dtype: torch.dtype, max_positions: int
) -> DraftHead:
    dcfg, state = read_draft(path, target.cfg)
    if dcfg.layer.num_heads % tp.size:
        raise ModelLoadError(f"tp_size {tp.size} does not divide the draft head's {dcfg.layer.num_heads} heads")
    head = DraftHead(dcfg, target, tp, dtype, max_positions)
    tensors = ((k, v) for k, v in state.items() if k not in ("d2t", "t2d", "draft_vocab"))
    load_weights(head, head.param_map(), tensors, ignore=(r"embed_tokens\.weight", r".*rotary_emb\.inv_freq"))
    if dcfg.kind == "eagle3":
        if "d2t" not in state:
            raise ModelLoadError("EAGLE-3 head has no d2t tensor (draft -> target vocabulary offsets)")
        head.d2t.copy_(state["d2t"].long())
    head = head.to(tp.device).eval()
    if dcfg.kind == "eagle" and "draft_vocab" in state:
        ids = state["draft_vocab"].long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target.cfg.vocab_size):
            raise ModelLoadError("draft_vocab holds ids outside the target's vocabulary")
        head.use_vocab_subset(ids)
    return head
