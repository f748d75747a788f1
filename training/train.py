"""`eaglegate train-draft`: self-distil an EAGLE head for a target model.

1. Data (train_data.py): one teacher-forced pass records the target's features and greedy next tokens.
2. Training (train_model.py) with training-time test: step d feeds the head its own step d-1 prediction; loss
   weighted 0.8^d, on assistant text only.
3. Saves the head and its README.md card; resumes from checkpoint.pt.
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

from speculative.heads import default_aux_layers
from worker.config import DEFAULT_MODEL, EngineConfig
from worker.dist import single_rank_group
from worker.model.files import resolve_model
from worker.model.loader import load_target

from .train_data import PART_TOKENS, collect, export_examples
from .train_model import TRAINABLE


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="eaglegate train-draft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument(
        "--out", required=True, help="output folder (also holds the recorded features/ and checkpoint.pt; both resume)"
    )
    p.add_argument("--prompts", default="sharegpt", choices=["sharegpt", "builtin"])
    p.add_argument("--num-prompts", type=int, default=600, help="prompts the target answers (self-distillation)")
    p.add_argument(
        "--distilled",
        action="store_true",
        help="train on the committed answers of `eaglegate distill` (speculative/answers/distilled/) "
        "instead of generating --num-prompts answers",
    )
    p.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="ShareGPT conversations the target reads teacher-forced (labels: its own greedy choices)",
    )
    p.add_argument("--init-from", default=None, help="warm-start from this eaglegate head folder (same --kind)")
    p.add_argument("--kind", default="eagle", choices=sorted(TRAINABLE), help="head layout: EAGLE-1/2 or EAGLE-3")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--max-len", type=int, default=384, help="tokens per training sequence")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--unroll", type=int, default=3, help="training-time-test depth")
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument(
        "--soft-topk",
        type=int,
        default=0,
        help="record the target's top-K next-token probabilities and train on them (EAGLE's soft "
        "cross-entropy, truncated to K and renormalised over the draft vocabulary) instead of its "
        "greedy token alone (0: hard labels)",
    )
    p.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary size (0: full)")
    p.add_argument(
        "--draft-intermediate",
        type=int,
        default=0,
        help="EAGLE-3 only: MLP units of the head's layer (0: the target's). Warm-starting from a "
        "narrower head keeps its units and adds new ones whose outputs start at zero",
    )
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--holdout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="steps between checkpoints; each also logs the held-out accept length to curve.json",
    )
    p.add_argument(
        "--examples",
        nargs="+",
        default=None,
        help="train on token ids saved by --export-examples (one file or several, joined) instead of "
        "building examples here",
    )
    p.add_argument(
        "--export-examples",
        default=None,
        help="save the examples (token ids and assistant spans, no text) to this file and stop",
    )
    p.add_argument(
        "--bf16-autocast",
        action="store_true",
        help="matmuls in bfloat16 under autocast (weights and optimizer stay float32): about 1.35x "
        "faster steps on CPUs with AVX512-BF16",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=0,
        help="stop training after this many seconds and save the head (0: no limit)",
    )
    p.add_argument(
        "--record-tokens",
        type=int,
        default=0,
        help="tokens per teacher-forced forward when recording features (0: 8192 on a GPU, else --max-len)",
    )
    p.add_argument(
        "--part-tokens",
        type=int,
        default=PART_TOKENS,
        help="tokens per part file of the recorded features: what recording holds in memory, and what "
        "an interrupted recording redoes at most",
    )
    p.add_argument(
        "--no-data-cache",
        action="store_true",
        help="keep the recorded features in memory only (no out/features/: tens of GB for 10K answers)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where features are recorded and the head trains (auto: cuda when present)",
    )
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.draft_intermediate and args.kind != "eagle3":
        p.error("--draft-intermediate needs --kind eagle3 (an EAGLE-1/2 head starts as the target's last layer)")
    return args


def losses(model, batch, vocab_index, args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted TTT loss and, per step, which positions predicted the target's next token (for acceptance).

    Step d at position t reads token x_{t+d+1} and predicts the target's feature at t+d+1 and its greedy choice
    there (labels[t+d+1]); only positions whose prediction lands in assistant text count."""
    ids, feats, labels, mask = batch[:4]
    soft = batch[4:]  # (top-K ids [B,T,K], their probabilities) with --soft-topk
    B, T, _ = feats.shape
    outs = model(ids, feats, args.unroll, args.noise if model.training else 0.0)
    total, correct = 0.0, []
    for d, out in enumerate(outs):
        valid = F.pad(mask[:, d + 1 :], (0, d + 1))
        tgt_feat = F.pad(feats[:, d + 1 :], (0, 0, 0, d + 1)) if model.feature_weight else None
        tgt_tok = F.pad(labels[:, d + 1 :], (0, d + 1))
        logits = model.logits(out[valid])
        target = vocab_index[tgt_tok[valid]]
        if soft:
            loss = args.ce_weight * soft_cross_entropy(
                logits, *(F.pad(x[:, d + 1 :], (0, 0, 0, d + 1))[valid] for x in soft), vocab_index
            )
        else:
            loss = args.ce_weight * F.cross_entropy(logits, target, ignore_index=-1)
        if model.feature_weight:
            loss = loss + model.feature_weight * F.smooth_l1_loss(out[valid], tgt_feat[valid])
        total = total + (0.8**d) * loss
        hit = torch.zeros(B, T, dtype=torch.bool, device=out.device)
        hit[valid] = logits.argmax(-1) == target
        correct.append((hit, valid))
    return total, correct


def soft_cross_entropy(logits, top_ids, top_p, vocab_index) -> torch.Tensor:
    """-sum p log q over the target's top-K tokens inside the draft vocabulary, p renormalised there: the draft
    learns how the target ranks its alternatives (what a top-k tree verifies), not its first choice alone."""
    idx = vocab_index[top_ids.long()]  # [N, K], -1 outside the draft vocabulary
    p = torch.where(idx >= 0, top_p.float(), 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, idx.clamp_min(0))
    return -(p * logq).sum(-1).mean()


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


def batches(data: dict, indices, batch_size, shuffle, rng, device: str = "cpu"):
    """Length-bucketed padded batches: (ids [B,T], feats [B,T,h], labels [B,T], mask [B,T]) on `device`."""
    seqs = data["seqs"]
    order = sorted(indices, key=lambda i: len(seqs[i]))
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        rng.shuffle(groups)
    for g in groups:
        T = max(len(seqs[i]) for i in g)
        ids = torch.zeros(len(g), T, dtype=torch.long)
        labels = torch.zeros(len(g), T, dtype=torch.long)
        mask = torch.zeros(len(g), T, dtype=torch.bool)
        soft = "soft_ids" in data
        if soft:
            k = data["soft_topk"]
            top_ids, top_p = torch.zeros(len(g), T, k, dtype=torch.int32), torch.zeros(len(g), T, k)
        first = data["feats"][g[0]]
        f = torch.zeros(len(g), T, first.shape[-1], device=first.device)  # where the features are kept
        for r, i in enumerate(g):
            n = len(seqs[i])
            ids[r, :n] = torch.tensor(seqs[i])
            f[r, :n] = data["feats"][i].float()
            labels[r, :n] = data["labels"][i].long()
            mask[r, :n] = data["masks"][i]
            if soft:
                top_ids[r, :n], top_p[r, :n] = data["soft_ids"][i], data["soft_p"][i].float()
        out = (ids, f, labels, mask) + ((top_ids, top_p) if soft else ())
        yield tuple(t.to(device, non_blocking=True) for t in out)


def evaluate(model, data, idx, vocab_index, args) -> dict:
    model.eval()
    taus, n = [], 0
    with torch.no_grad():
        for batch in batches(data, idx, args.batch_size, False, None, args.device):
            _, correct = losses(model, batch, vocab_index, args)
            taus.append(expected_accept_length(correct) * len(batch[0]))
            n += len(batch[0])
    model.train()
    return {"heldout_tau": sum(taus) / max(n, 1)}


def log_curve(out: Path, step: int, tau: float, seconds: float) -> None:
    """Held-out accept length per checkpoint, appended to out/curve.json (kept across resumed runs): where the
    curve flattens says when more steps stop paying."""
    path = out / "curve.json"
    curve = [c for c in (json.loads(path.read_text()) if path.exists() else []) if c["step"] < step]
    curve.append({"step": step, "heldout_tau": round(tau, 4), "seconds": round(seconds, 1)})
    path.write_text(json.dumps(curve, indent=1) + "\n")
    tqdm.write(f"step {step}: held-out expected accept length {tau:.3f}")


def warm_start(model, folder: str) -> None:
    """Continue training a saved head of the same layout (e.g. on more data)."""
    from safetensors.torch import load_file

    model.load_export({k: v.float() for k, v in load_file(str(Path(folder) / "model.safetensors")).items()})


def float_target(model_path: str):
    """The target with dense float32 weights (a GGUF's blocks dequantized), whichever CPU kernel serves here: the
    head starts from its weights and trains against its embeddings, so it reads them as plain tensors, never in the
    layout a quantized kernel packs them in."""
    config = EngineConfig(model_path=model_path, dtype="float32", quantization="none")
    return load_target(config, resolve_model(model_path), single_rank_group(torch.device("cpu")), torch.float32)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    if args.export_examples:
        export_examples(args, out, Path(args.export_examples))
        return 0
    data = collect(args, out)
    if data.get("soft_topk", 0) != args.soft_topk:
        raise SystemExit(
            f"{out} holds soft labels of top-{data.get('soft_topk', 0)} (0: none), not "
            f"--soft-topk {args.soft_topk}: pass that, or record into a new --out"
        )
    seqs = data["seqs"]
    target, cfg = float_target(args.model_path)
    # FR-Spec: the draft vocabulary is what the draft must predict most often (labels inside assistant text)
    counts = torch.bincount(
        torch.cat([lab[m].long() for lab, m in zip(data["labels"], data["masks"])]), minlength=cfg.vocab_size
    )
    k = args.draft_vocab or cfg.vocab_size
    draft_vocab = torch.sort(torch.topk(counts, k).indices).values
    vocab_index = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    vocab_index[draft_vocab] = torch.arange(k)
    coverage = counts[draft_vocab].sum().item() / max(counts.sum().item(), 1)
    wide = {"intermediate": args.draft_intermediate} if args.draft_intermediate else {}
    model = TRAINABLE[args.kind](target, draft_vocab, **wide)
    if args.init_from:
        warm_start(model, args.init_from)
    model.to(args.device)
    vocab_index = vocab_index.to(args.device)
    idx = list(range(len(seqs)))
    rng.shuffle(idx)
    n_hold = max(1, int(len(idx) * args.holdout))
    held, train = idx[:n_hold], idx[n_hold:]
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.time()

    def progress(s: int) -> float:
        """How far through training: by steps, or by the time box when that is further along (its cosine then
        still ends at zero)."""
        done = min(s, total_steps) / total_steps
        return min(1.0, max(done, (time.time() - t0) / args.max_seconds)) if args.max_seconds else done

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * progress(s)))
    )
    step, log, trained_seconds = 0, [], 0.0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False, map_location=args.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, log, rng = state["step"], state["log"], state["rng"]
        trained_seconds = state.get("seconds", 0.0)
        print(f"resumed from step {step}")
    start = evaluate(model, data, held, vocab_index, args)
    print(f"before training: held-out expected accept length {start['heldout_tau']:.3f}")
    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step")
    # the time box counts training only, not the evaluation above; a resumed run continues its box (and its cosine)
    t0 = time.time() - trained_seconds
    while step < total_steps:
        for batch in batches(data, train, args.batch_size, True, rng, args.device):
            with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16_autocast):
                loss, correct = losses(model, batch, vocab_index, args)
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
                torch.save(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "sched": sched.state_dict(),
                        "step": step,
                        "log": log,
                        "rng": rng,
                        "seconds": time.time() - t0,
                    },
                    ckpt,
                )
                log_curve(out, step, evaluate(model, data, held, vocab_index, args)["heldout_tau"], time.time() - t0)
                # every checkpoint servable, so bench/spec_curve.py can measure accept length and speed along the way
                export_head(model, cfg, draft_vocab, out / "heads" / f"step-{step:05d}", {"steps": step})
            if step >= total_steps or (args.max_seconds and time.time() - t0 > args.max_seconds):
                break
        if args.max_seconds and time.time() - t0 > args.max_seconds:
            print(f"time box: stopped after {step} of {total_steps} steps")
            break
    bar.close()
    final = evaluate(model, data, held, vocab_index, args)
    print(f"after {step} steps: held-out expected accept length {final['heldout_tau']:.3f}")
    save_head(
        model,
        cfg,
        draft_vocab,
        out,
        args,
        {
            "steps": step,
            "train_seconds": round(time.time() - t0, 1),
            "train_sequences": len(train),
            "train_tokens": sum(len(seqs[i]) for i in train),
            "answers": data["answers"],
            "conversations": data["conversations"],
            "heldout_tau_before": round(start["heldout_tau"], 3),
            "heldout_tau_after": round(final["heldout_tau"], 3),
            "draft_vocab_coverage": round(coverage, 4),
            "final_loss": round(log[-1]["loss"], 4) if log else None,
            "prompt_source": data["prompt_source"],
        },
    )
    return 0


def export_head(model, cfg, draft_vocab, out: Path, facts: dict) -> None:
    """model.safetensors + config.json: a head the engine serves."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v if k == "d2t" else v.to(torch.bfloat16)).contiguous() for k, v in model.export().items()}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "eagle_kind": model.kind,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": model.down.shape[1],
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": len(draft_vocab),
    }
    if model.kind == "eagle":
        state["draft_vocab"] = draft_vocab.to(torch.int64)
        config["bias"] = True
    else:
        aux = list(default_aux_layers(cfg.num_layers))
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    config["training"] = facts
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def save_head(model, cfg, draft_vocab, out: Path, args, facts: dict) -> None:
    export_head(model, cfg, draft_vocab, out, facts)
    layout = (
        "EAGLE-1/2 layout (fc over [token embedding; target feature], one Llama decoder layer, the "
        "target's LM head), restricted at draft time to"
        if model.kind == "eagle"
        else f"EAGLE-3 layout (fc fusing target layers {list(default_aux_layers(cfg.num_layers))}, a 2h-input "
        f"decoder layer of {model.down.shape[1]} MLP units, its own LM head with d2t) over"
    )
    cmd = (
        f"eaglegate train-draft --kind {args.kind} --out {out.name} --prompts {args.prompts} "
        f"--num-prompts {args.num_prompts} --conversations {args.conversations} "
        f"--max-new-tokens {args.max_new_tokens} --max-len {args.max_len} --epochs {args.epochs} "
        f"--batch-size {args.batch_size} --lr {args.lr} --ce-weight {args.ce_weight} --unroll {args.unroll} "
        f"--draft-vocab {args.draft_vocab} --seed {args.seed}"
    )
    if args.draft_intermediate:
        cmd += f" --draft-intermediate {args.draft_intermediate}"
    if args.max_steps:
        cmd += f" --max-steps {args.max_steps} --checkpoint-every {args.checkpoint_every}"
    if args.init_from:
        cmd += f" --init-from {args.init_from}"
    if args.soft_topk:
        cmd += f" --soft-topk {args.soft_topk}"
    cmd += "".join(f" --{flag.replace('_', '-')}" for flag in ("distilled", "bf16_autocast") if getattr(args, flag))
    if args.examples:
        cmd += " --examples " + " ".join(Path(e).name for e in args.examples)
    (out / "README.md").write_text(f"""# EAGLE head for {args.model_path}

{layout} the {len(draft_vocab)} most frequent target choices in the training data (FR-Spec;
coverage {facts["draft_vocab_coverage"]:.1%}).

- Data: {facts["train_sequences"]} training sequences ({facts["train_tokens"]} tokens): {facts["answers"]} prompts
  from `{facts["prompt_source"]}` answered greedily by the target itself (self-distillation) and
  {facts["conversations"]} ShareGPT conversations read by the target, teacher-forced. Labels are the target's own
  greedy next tokens; only positions inside assistant text count. Never MT-bench.
- Training: {facts["steps"]} AdamW steps, training-time test depth {args.unroll}, {facts["train_seconds"]} s on
  {torch.cuda.get_device_name() if args.device == "cuda" else "this machine's CPU"}.
- Held-out expected accept length (tokens per verify step, {args.unroll}-step chain, bonus included):
  {facts["heldout_tau_before"]} at the start, {facts["heldout_tau_after"]} after.

Reproduce: `{cmd}`
""")
