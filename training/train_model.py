"""Trainable EAGLE heads (full weights, tp=1, float32) with training-time-test (TTT) forwards.

Step d of the unrolled forward feeds the head its own step d-1 output, under the attention pattern it sees at
inference: the true context up to t, then its own chain (one key per earlier step, on the diagonal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.layers import RotaryEmbedding

Param = nn.Parameter


def _f32(t: torch.Tensor) -> Param:
    return Param(t.detach().float().clone())


def _normal(*shape: int) -> Param:
    return Param(torch.randn(*shape) * 0.02)


def _widen(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of `rows`, continued with small random rows where it has fewer."""
    return torch.cat([rows[:n], torch.randn(max(n - len(rows), 0), rows.shape[1]) * 0.02])


class _TTTLayer(nn.Module):
    """A Llama decoder layer's attention + MLP, unrolled with TTT masks. Subclasses say what enters it."""

    feature_weight = 1.0  # weight of the feature (SmoothL1) loss beside the token loss

    def _setup(self, target) -> None:
        cfg = target.cfg
        self.h, self.heads, self.kv_heads, self.hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        # buffers, not parameters: frozen, moved by .to(device), and left out of checkpoints
        self.register_buffer("embed", target.embed_tokens.weight.detach().float(), persistent=False)
        # the head's own rotary over whole heads (a GLM-4 MoE target turns only half of each of its heads)
        rope = RotaryEmbedding(cfg.head_dim, target.rope.cos.shape[0], cfg.rope_theta, cfg.rope_scaling_dict)
        self.register_buffer("cos", rope.cos, persistent=False)
        self.register_buffer("sin", rope.sin, persistent=False)

    def _rope(self, x, pos):
        cos, sin = self.cos[pos].unsqueeze(-2), self.sin[pos].unsqueeze(-2)  # [B,T,1,D]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def _norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * w

    def _attention(self, x, d: int, keys: list, values: list):
        B, T, _ = x.shape
        q_size, kv_size = self.heads * self.hd, self.kv_heads * self.hd
        q, k, v = F.linear(x, self.qkv).split([q_size, kv_size, kv_size], dim=-1)
        base = torch.arange(T, device=x.device)
        pos = (base + d).clamp(max=self.cos.shape[0] - 1).expand(B, T)
        q = self._rope(q.view(B, T, self.heads, self.hd), pos)
        keys.append(self._rope(k.view(B, T, self.kv_heads, self.hd), pos))
        values.append(v.view(B, T, self.kv_heads, self.hd))
        K = torch.cat(keys, dim=1).transpose(1, 2)
        V = torch.cat(values, dim=1).transpose(1, 2)
        causal = base.view(T, 1) >= base.view(1, T)
        mask = torch.cat([causal] + [torch.eye(T, dtype=torch.bool, device=x.device)] * d, dim=1)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, attn_mask=mask, enable_gqa=True)
        return F.linear(a.transpose(1, 2).reshape(B, T, q_size), self.o)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, unroll: int, noise: float) -> list[torch.Tensor]:
        """ids [B,T] tokens, feats [B,T,*] target features -> each TTT step's output [B,T,h]."""
        inp = self._first_input(feats, noise)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for d in range(unroll):
            tok = F.pad(ids[:, d + 1 :], (0, d + 1))  # x_{t+d+1}
            inp = self._step(self.embed[tok], inp, d, keys, values)
            outs.append(inp)  # the next step reads this step's prediction, as at inference
        return outs

    def _mlp(self, x):
        g, u = F.linear(self._norm(x, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.down)

    def _layer_names(self, p: str) -> list[tuple[str, str]]:
        """(attribute, checkpoint name) of the unfused layer weights."""
        return [
            ("o", p + "self_attn.o_proj.weight"),
            ("down", p + "mlp.down_proj.weight"),
            ("post_norm", p + "post_attention_layernorm.weight"),
        ]

    def _export_layer(self, p: str) -> dict[str, torch.Tensor]:
        """The decoder layer's weights under Hugging Face names (fused qkv / gate_up split back)."""
        q_size, kv_size = self.heads * self.hd, self.kv_heads * self.hd
        q, k, v = self.qkv.detach().split([q_size, kv_size, kv_size])
        g, u = self.gate_up.detach().chunk(2)
        out = {
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "mlp.gate_proj.weight": g,
            p + "mlp.up_proj.weight": u,
        }
        return out | {key: getattr(self, name).detach() for name, key in self._layer_names(p)}

    def _load(self, state: dict[str, torch.Tensor], p: str, extra: list[tuple[str, str]]) -> None:
        """Warm start from a saved head of this layout. A saved MLP narrower than this head's fills its first
        units; the new units keep their random inputs and start with zero outputs, so the head starts as the saved
        one and grows from there."""
        down = state[p + "mlp.down_proj.weight"]
        inter, saved = self.down.shape[1], down.shape[1]
        if saved > inter:
            raise ValueError(f"the saved head's MLP has {saved} units, more than this head's {inter}")
        with torch.no_grad():
            for name, key in self._layer_names(p) + extra:
                if name != "down":
                    getattr(self, name).copy_(state[key])
            self.down.zero_()
            self.down[:, :saved] = down
            self.qkv.copy_(torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            for i, name in enumerate(("gate", "up")):
                self.gate_up[i * inter : i * inter + saved] = state[p + f"mlp.{name}_proj.weight"]


class TrainableEagle(_TTTLayer):
    """EAGLE-1/2: fc over [token embedding; target feature], one decoder layer without input norm, the target's
    (frozen) LM head restricted to the draft vocabulary. Starts as a pass-through of the target's last layer."""

    kind = "eagle"

    def __init__(self, target, draft_vocab: torch.Tensor):
        super().__init__()
        self._setup(target)
        h, src = self.h, target.layers[-1]
        self.fc_w = Param(torch.cat([torch.randn(h, h) * 0.01, torch.eye(h)], dim=1))
        self.fc_b = Param(torch.zeros(h))
        self.qkv = _f32(src.self_attn.qkv_proj.weight)
        self.o = Param(torch.zeros_like(src.self_attn.o_proj.weight, dtype=torch.float32))  # residual starts at 0
        self.gate_up = _f32(src.mlp.gate_up_proj.weight)
        self.down = Param(torch.zeros_like(src.mlp.down_proj.weight, dtype=torch.float32))
        self.post_norm = _f32(src.post_attention_layernorm.weight)
        self.register_buffer("lm_sub", target.lm_head.weight.detach().float()[draft_vocab], persistent=False)

    def _first_input(self, feats: torch.Tensor, noise: float) -> torch.Tensor:
        """feats: the target's final hidden states, with EAGLE's uniform training noise."""
        return feats + (torch.rand_like(feats) * 2 - 1) * noise if noise else feats

    def _step(self, embeds, inp, d: int, keys: list, values: list) -> torch.Tensor:
        x = F.linear(torch.cat([embeds, inp], dim=-1), self.fc_w, self.fc_b)
        x = x + self._attention(x, d, keys, values)
        return x + self._mlp(x)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return F.linear(out, self.lm_sub)

    def export(self) -> dict[str, torch.Tensor]:
        return {"fc.weight": self.fc_w.detach(), "fc.bias": self.fc_b.detach()} | self._export_layer("layers.0.")

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        self._load(state, "layers.0.", [("fc_w", "fc.weight"), ("fc_b", "fc.bias")])


class TrainableEagle3(_TTTLayer):
    """EAGLE-3: fc fuses three target layers (low, mid, high) into the feature; the layer attends over
    [norm(embedding); norm(feature)] (2h wide); its own norm and LM head over the draft vocabulary (trained, with
    d2t offsets). Token loss only, as in EAGLE-3."""

    kind = "eagle3"
    feature_weight = 0.0

    def __init__(self, target, draft_vocab: torch.Tensor, intermediate: int = 0):
        super().__init__()
        self._setup(target)
        h, src = self.h, target.layers[-1]
        q_size, kv_size = self.heads * self.hd, self.kv_heads * self.hd
        self.fc_w = Param(nn.Linear(3 * h, h, bias=False).weight.detach().clone())
        self.in_norm = Param(torch.ones(h))
        self.hid_norm = Param(torch.ones(h))
        self.qkv = _normal(q_size + 2 * kv_size, 2 * h)
        self.o = _normal(h, q_size)
        gate, up = src.mlp.gate_up_proj.weight.detach().float().chunk(2)
        inter = intermediate or gate.shape[0]  # a wider MLP than the target's: more capacity, same attention
        self.gate_up = Param(torch.cat([_widen(gate, inter), _widen(up, inter)]))
        self.down = _normal(h, inter)
        self.post_norm = _f32(src.post_attention_layernorm.weight)
        self.norm = _f32(target.norm.weight)
        self.lm_head = _f32(target.lm_head.weight[draft_vocab])
        self.register_buffer("draft_vocab", draft_vocab, persistent=False)

    def _first_input(self, feats: torch.Tensor, noise: float) -> torch.Tensor:
        """feats: the target's low/mid/high residual streams [B,T,3h], fused to h."""
        return F.linear(feats, self.fc_w)

    def _step(self, embeds, inp, d: int, keys: list, values: list) -> torch.Tensor:
        x = torch.cat([self._norm(embeds, self.in_norm), self._norm(inp, self.hid_norm)], dim=-1)
        y = inp + self._attention(x, d, keys, values)
        return y + self._mlp(y)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(out, self.norm), self.lm_head)

    def export(self) -> dict[str, torch.Tensor]:
        p = "midlayer."
        vocab = self.draft_vocab.cpu()
        d2t = vocab - torch.arange(len(vocab))  # draft id + d2t[id] = target id
        return (
            {"d2t": d2t.to(torch.int64)}
            | {key: getattr(self, name).detach() for name, key in self._extra(p)}
            | self._export_layer(p)
        )

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        """The saved LM head's rows follow its own draft vocabulary (d2t); new data picks another, so rows are
        matched by target token id. Tokens the saved head never drafted start at zero (logit 0): the target's own LM
        head rows, a fresh head's start, outscale the trained rows and would win every argmax (held-out accept length
        1.00 instead of 1.63, measured)."""
        extra = [(n, k) for n, k in self._extra("midlayer.") if n != "lm_head"]
        self._load(state, "midlayer.", extra)
        saved = torch.arange(len(state["d2t"])) + state["d2t"].long()  # draft row -> target id
        row_of = torch.full((int(max(saved.max(), self.draft_vocab.max())) + 1,), -1, dtype=torch.long)
        row_of[saved] = torch.arange(len(saved))
        rows = row_of[self.draft_vocab.cpu()]
        kept = rows >= 0
        with torch.no_grad():
            self.lm_head.zero_()
            self.lm_head[kept.to(self.lm_head.device)] = state["lm_head.weight"][rows[kept]].to(self.lm_head)

    @staticmethod
    def _extra(p: str) -> list[tuple[str, str]]:
        return [
            ("fc_w", "fc.weight"),
            ("norm", "norm.weight"),
            ("lm_head", "lm_head.weight"),
            ("in_norm", p + "input_layernorm.weight"),
            ("hid_norm", p + "hidden_norm.weight"),
        ]


TRAINABLE = {"eagle": TrainableEagle, "eagle3": TrainableEagle3}
