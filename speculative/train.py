"""`eaglegate train-draft`: self-distil an EAGLE head for a target model on this machine.

1. The target answers a prompt corpus through the engine (batched, greedy).
2. A teacher-forced pass records the target's features (final hidden states) for prompt + answer.
3. The head is trained with training-time test (TTT): step d feeds the head its own step d-1 prediction, with the
   attention pattern it sees at inference (true context up to t, its own chain on the diagonal). Loss: SmoothL1 on
   features + w * cross-entropy on the next token over the draft vocabulary (the K most frequent tokens: FR-Spec),
   step d weighted 0.8^d. AdamW, betas (0.9, 0.95), grad clip 0.5, uniform feature noise (EAGLE's recipe).
4. Saves an EAGLE-layout head (config.json + model.safetensors + README.md card); resumable from checkpoint.pt.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from worker.config import DEFAULT_MODEL, EngineConfig
from worker.dist import single_rank_group
from worker.loader import load_target
from worker.model_files import resolve_model
from worker.protocol import StepPlan
from worker.runner import ModelRunner

from .data import training_prompts


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eaglegate train-draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--out", required=True, help="output folder (also holds data.pt and checkpoint.pt)")
    p.add_argument("--prompts", default="sharegpt", choices=["sharegpt", "builtin"])
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--max-len", type=int, default=384, help="tokens per training sequence")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--unroll", type=int, default=3, help="training-time-test depth")
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary size (0: full)")
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--holdout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    return p.parse_args(argv)


# --- data ---------------------------------------------------------------------------------------------------
def collect(args, out: Path) -> dict:
    """Prompt -> greedy answer through the engine -> teacher-forced features. Cached in out/data.pt."""
    cache = out / "data.pt"
    if cache.exists():
        return torch.load(cache, weights_only=False)
    from worker.engine import Engine
    from worker.sampling import SamplingParams

    prompts = training_prompts(args.prompts, args.num_prompts, args.seed)
    with Engine(EngineConfig(model_path=args.model_path, dtype=args.dtype, max_total_tokens=65536,
                             max_running_requests=64)) as engine:
        tok = engine.tokenizer
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in prompts]
        ids = [x["input_ids"] if not isinstance(x, list) else x for x in ids]
        ids = [x[: args.max_len - 32] for x in ids]
        t0 = time.time()
        results = []
        for i in tqdm(range(0, len(ids), 64), desc="generating answers", unit="batch"):
            results += engine.generate(ids[i : i + 64], SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                       temperature=0))
        gen_s = time.time() - t0
    seqs = [(p + r.token_ids)[: args.max_len] for p, r in zip(ids, results)]
    config = EngineConfig(model_path=args.model_path, dtype=args.dtype, max_total_tokens=args.max_len + 16)
    runner = ModelRunner(config, resolve_model(args.model_path), single_rank_group(torch.device("cpu")))
    feats = []
    blocks = list(range(runner.num_blocks))
    for s in tqdm(seqs, desc="recording features", unit="seq"):
        plan = StepPlan(0, "forward", s, [(0, len(s), blocks)], [len(s) - 1])
        with torch.inference_mode():
            _, hidden, _ = runner.forward(plan)
        feats.append(hidden.to(torch.bfloat16).clone())
    data = {"seqs": seqs, "feats": feats, "num_prompts": len(prompts), "generation_seconds": gen_s,
            "prompt_source": args.prompts}
    torch.save(data, cache)
    return data


# --- model --------------------------------------------------------------------------------------------------
class TrainableEagle(torch.nn.Module):
    """The EAGLE-1/2 head's parameters (full, tp=1) plus a training forward with TTT attention masks."""

    def __init__(self, target, draft_vocab: torch.Tensor):
        super().__init__()
        cfg = target.cfg
        h, self.heads, self.kv_heads, self.hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        src = target.layers[-1]  # initialise the draft layer from the target's last layer
        f32 = lambda t: torch.nn.Parameter(t.detach().float().clone())  # noqa: E731
        self.fc_w = torch.nn.Parameter(torch.cat([torch.randn(h, h) * 0.01, torch.eye(h)], dim=1))
        self.fc_b = torch.nn.Parameter(torch.zeros(h))
        self.qkv = f32(src.self_attn.qkv_proj.weight)
        # residual branches start at zero: the untrained head passes the feature through (a sane start)
        self.o = torch.nn.Parameter(torch.zeros_like(src.self_attn.o_proj.weight, dtype=torch.float32))
        self.gate_up = f32(src.mlp.gate_up_proj.weight)
        self.down = torch.nn.Parameter(torch.zeros_like(src.mlp.down_proj.weight, dtype=torch.float32))
        self.post_norm = f32(src.post_attention_layernorm.weight)
        self.eps = cfg.rms_norm_eps
        self.embed = target.embed_tokens.weight.detach().float()
        self.lm_sub = target.lm_head.weight.detach().float()[draft_vocab]
        self.cos, self.sin = target.rope.cos, target.rope.sin

    def _rope(self, x, pos):
        cos, sin = self.cos[pos].unsqueeze(-2), self.sin[pos].unsqueeze(-2)  # [B,T,1,D]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, unroll: int, noise: float) -> list[torch.Tensor]:
        """ids [B,T] tokens, feats [B,T,h] target features. Returns each step's predicted features [B,T,h]."""
        B, T, h = feats.shape
        q_size, kv_size = self.heads * self.hd, self.kv_heads * self.hd
        inp = feats + (torch.rand_like(feats) * 2 - 1) * noise if noise else feats
        keys, values, outs = [], [], []
        base = torch.arange(T)
        causal = base.view(T, 1) >= base.view(1, T)
        diag = torch.eye(T, dtype=torch.bool)
        for d in range(unroll):
            tok = F.pad(ids[:, d + 1 :], (0, d + 1))  # x_{t+d+1}
            x = F.linear(torch.cat([self.embed[tok], inp], dim=-1), self.fc_w, self.fc_b)
            q, k, v = F.linear(x, self.qkv).split([q_size, kv_size, kv_size], dim=-1)
            pos = (base + d).clamp(max=self.cos.shape[0] - 1).expand(B, T)
            q = self._rope(q.view(B, T, self.heads, self.hd), pos)
            k = self._rope(k.view(B, T, self.kv_heads, self.hd), pos)
            keys.append(k)
            values.append(v.view(B, T, self.kv_heads, self.hd))
            K = torch.cat(keys, dim=1).transpose(1, 2)
            V = torch.cat(values, dim=1).transpose(1, 2)
            mask = torch.cat([causal] + [diag] * d, dim=1)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, q_size), self.o)
            n = F.rms_norm(x, (h,), eps=self.eps) * self.post_norm
            g, u = F.linear(n, self.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, self.down)
            outs.append(x)
            inp = x  # the next step sees this step's prediction, as at inference
        return outs

    def state_for_eagle(self) -> dict[str, torch.Tensor]:
        q_size, kv_size = self.heads * self.hd, self.kv_heads * self.hd
        q, k, v = self.qkv.detach().split([q_size, kv_size, kv_size])
        g, u = self.gate_up.detach().chunk(2)
        p = "layers.0."
        return {"fc.weight": self.fc_w.detach(), "fc.bias": self.fc_b.detach(),
                p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": self.o.detach(), p + "mlp.gate_proj.weight": g,
                p + "mlp.up_proj.weight": u, p + "mlp.down_proj.weight": self.down.detach(),
                p + "post_attention_layernorm.weight": self.post_norm.detach()}


def losses(model: TrainableEagle, ids, feats, lengths, vocab_index, args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted TTT loss and, per step, which positions predicted the next token correctly (for acceptance)."""
    B, T, _ = feats.shape
    outs = model(ids, feats, args.unroll, args.noise if model.training else 0.0)
    total, correct = 0.0, []
    t = torch.arange(T)
    for d, out in enumerate(outs):
        valid = (t.view(1, T) + d + 2) < lengths.view(B, 1)
        tgt_feat = F.pad(feats[:, d + 1 :], (0, 0, 0, d + 1))
        tgt_tok = F.pad(ids[:, d + 2 :], (0, d + 2))
        feat_loss = F.smooth_l1_loss(out[valid], tgt_feat[valid])
        logits = F.linear(out[valid], model.lm_sub)
        labels = vocab_index[tgt_tok[valid]]
        ce = F.cross_entropy(logits, labels, ignore_index=-1)
        total = total + (0.8**d) * (feat_loss + args.ce_weight * ce)
        hit = torch.zeros(B, T, dtype=torch.bool)
        hit[valid] = logits.argmax(-1) == labels
        correct.append((hit, valid))
    return total, correct


def expected_accept_length(correct) -> float:
    """1 + sum over steps of P(every step up to d correct), over positions where all steps are valid."""
    valid = correct[-1][1]
    if not valid.any():
        return 1.0
    chain, tau = torch.ones_like(valid), 1.0
    for hit, _ in correct:
        chain = chain & hit
        tau += chain[valid].float().mean().item()
    return tau


def batches(seqs, feats, indices, batch_size, shuffle, rng):
    order = sorted(indices, key=lambda i: len(seqs[i]))
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        rng.shuffle(groups)
    for g in groups:
        T = max(len(seqs[i]) for i in g)
        ids = torch.zeros(len(g), T, dtype=torch.long)
        f = torch.zeros(len(g), T, feats[g[0]].shape[-1])
        for r, i in enumerate(g):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            f[r, : len(seqs[i])] = feats[i].float()
        yield ids, f, torch.tensor([len(seqs[i]) for i in g])


def evaluate(model, data, idx, vocab_index, args) -> dict:
    model.eval()
    taus, n = [], 0
    with torch.no_grad():
        for ids, f, lens in batches(data["seqs"], data["feats"], idx, args.batch_size, False, None):
            _, correct = losses(model, ids, f, lens, vocab_index, args)
            taus.append(expected_accept_length(correct) * len(lens))
            n += len(lens)
    model.train()
    return {"heldout_tau": sum(taus) / max(n, 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data = collect(args, out)
    seqs = data["seqs"]
    target, cfg = load_target(EngineConfig(model_path=args.model_path), resolve_model(args.model_path),
                              single_rank_group(torch.device("cpu")), torch.float32)
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=cfg.vocab_size)
    k = args.draft_vocab or cfg.vocab_size
    draft_vocab = torch.sort(torch.topk(counts, k).indices).values
    vocab_index = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    vocab_index[draft_vocab] = torch.arange(k)
    coverage = counts[draft_vocab].sum().item() / max(counts.sum().item(), 1)
    model = TrainableEagle(target, draft_vocab)
    idx = list(range(len(seqs)))
    rng.shuffle(idx)
    n_hold = max(1, int(len(idx) * args.holdout))
    held, train = idx[:n_hold], idx[n_hold:]
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    step, log = 0, []
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, log, rng = state["step"], state["log"], state["rng"]
        print(f"resumed from step {step}")
    start = evaluate(model, data, held, vocab_index, args)
    print(f"before training: held-out expected accept length {start['heldout_tau']:.3f}")
    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step")
    t0 = time.time()
    while step < total_steps:
        for ids, f, lens in batches(seqs, data["feats"], train, args.batch_size, True, rng):
            loss, correct = losses(model, ids, f, lens, vocab_index, args)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", tau=f"{expected_accept_length(correct):.2f}")
            log.append({"step": step, "loss": loss.item()})
            if step % args.checkpoint_every == 0 or step >= total_steps:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step, "log": log, "rng": rng}, ckpt)
            if step >= total_steps:
                break
    bar.close()
    final = evaluate(model, data, held, vocab_index, args)
    print(f"after {step} steps: held-out expected accept length {final['heldout_tau']:.3f}")
    save_head(model, cfg, draft_vocab, out, args, {
        "steps": step, "train_seconds": round(time.time() - t0, 1), "train_sequences": len(train),
        "train_tokens": sum(len(seqs[i]) for i in train), "heldout_tau_before": round(start["heldout_tau"], 3),
        "heldout_tau_after": round(final["heldout_tau"], 3), "draft_vocab_coverage": round(coverage, 4),
        "final_loss": round(log[-1]["loss"], 4) if log else None, "prompt_source": data["prompt_source"]})
    return 0


def save_head(model: TrainableEagle, cfg, draft_vocab, out: Path, args, facts: dict) -> None:
    from safetensors.torch import save_file

    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_for_eagle().items()}
    state["draft_vocab"] = draft_vocab.to(torch.int64)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "eagle_kind": "eagle", "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size, "bias": True,
              "draft_vocab_size": len(draft_vocab), "training": facts}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    cmd = (f"eaglegate train-draft --out {out.name} --prompts {args.prompts} --num-prompts {args.num_prompts} "
           f"--max-new-tokens {args.max_new_tokens} --max-len {args.max_len} --epochs {args.epochs} "
           f"--batch-size {args.batch_size} --lr {args.lr} --unroll {args.unroll} --draft-vocab {args.draft_vocab} "
           f"--seed {args.seed}")
    (out / "README.md").write_text(f"""# EAGLE head for {args.model_path}

EAGLE-1/2 layout (fc over [token embedding; target feature], one Llama decoder layer, the target's LM head),
restricted at draft time to the {len(draft_vocab)} most frequent tokens of the training data (FR-Spec;
coverage {facts['draft_vocab_coverage']:.1%} of training tokens).

- Data: {facts['train_sequences']} training sequences ({facts['train_tokens']} tokens): prompts from
  `{facts['prompt_source']}` answered greedily by the target itself (self-distillation). Never MT-bench.
- Training: {facts['steps']} AdamW steps, training-time test depth {args.unroll}, {facts['train_seconds']} s on
  this machine's CPU.
- Held-out expected accept length (tokens per verify step, chain, bonus included):
  {facts['heldout_tau_before']} before training, {facts['heldout_tau_after']} after.

Reproduce: `{cmd}`
""")
