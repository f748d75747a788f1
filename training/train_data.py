"""Training data for `eaglegate train-draft`: examples (self-distilled answers, teacher-forced ShareGPT
conversations) and one teacher-forced target pass recording, per position, the draft's input feature, the
target's greedy next token (what a lossless verifier accepts) and whether the position is inside assistant text.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from speculative.heads import default_aux_layers
from worker.config import EngineConfig
from worker.dist import single_rank_group
from worker.layers import unpack_quantized_linears
from worker.model_files import resolve_model
from worker.protocol import ForwardPlan
from worker.runner import ModelRunner

from .data import sharegpt_conversations, training_prompts

Example = tuple[list[int], list[tuple[int, int]]]  # token ids, [start, end) spans of assistant text


def chat_ids(tok, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    x = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(x if isinstance(x, list) else x["input_ids"])


def generate_answers(args, out: Path) -> list[Example]:
    """Self-distillation: the target answers the prompts greedily through the engine. Cached in out/answers.pt."""
    cache = out / "answers.pt"
    if cache.exists():
        return torch.load(cache, weights_only=False)
    if getattr(args, "distilled", False):
        return distilled_examples(args)
    if not args.num_prompts:
        return []
    from runtime.engine import Engine
    from worker.sampling import SamplingParams

    prompts = training_prompts(args.prompts, args.num_prompts, args.seed)
    with Engine(EngineConfig(model_path=args.model_path, dtype=args.dtype, max_total_tokens=65536,
                             max_running_requests=64)) as engine:
        ids = [chat_ids(engine.tokenizer, [{"role": "user", "content": p}], True)[: args.max_len - 32]
               for p in prompts]
        results = []
        for i in tqdm(range(0, len(ids), 64), desc="generating answers", unit="batch"):
            results += engine.generate(ids[i : i + 64], SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                       temperature=0))
    examples = [((p + r.token_ids)[: args.max_len], [(len(p), min(len(p) + len(r.token_ids), args.max_len))])
                for p, r in zip(ids, results)]
    torch.save(examples, cache)
    return examples


def distilled_examples(args) -> list[Example]:
    """The committed answers of `eaglegate distill`, each after its ShareGPT prompt rendered with the chat template."""
    from worker.tokenizer import load_tokenizer

    from .data import sharegpt_first_turns
    from .distill import read_answers

    tok = load_tokenizer(resolve_model(args.model_path))
    prompts = sharegpt_first_turns()
    examples = []
    for i, answer in tqdm(sorted(read_answers().items()), desc="distilled answers", unit="answer"):
        if answer:
            p = chat_ids(tok, [{"role": "user", "content": prompts[i]}], True)
            examples.append(((p + answer)[: args.max_len], [(len(p), min(len(p) + len(answer), args.max_len))]))
    return [e for e in examples if e[1][0][0] < e[1][0][1]]


def conversation_example(tok, messages: list[dict], max_len: int) -> Example:
    """A ShareGPT conversation rendered with the chat template, cut at max_len, with its assistant spans."""
    ids: list[int] = []
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        begin = len(chat_ids(tok, messages[:i], True))
        if begin >= max_len - 8:
            break
        ids = chat_ids(tok, messages[: i + 1], False)
        spans.append((begin, min(len(ids), max_len)))
        if len(ids) >= max_len:
            break
    return ids[:max_len], spans


def build_examples(args, out: Path) -> tuple[list[Example], int]:
    """(examples, how many are self-distilled answers): from --examples, or answers plus ShareGPT conversations."""
    if getattr(args, "examples", None):
        saved = torch.load(args.examples, weights_only=False)
        return [(ids.tolist(), spans) for ids, spans in saved["examples"]], saved["answers"]
    examples = generate_answers(args, out)
    num_answers = len(examples)
    if args.conversations:
        from worker.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model(args.model_path))
        convs = sharegpt_conversations(args.conversations, args.seed)
        examples += [conversation_example(tok, c, args.max_len) for c in tqdm(convs, desc="rendering", unit="conv")]
    return [(ids, spans) for ids, spans in examples if spans and len(ids) > 8], num_answers


def export_examples(args, out: Path, path: Path) -> None:
    """Token ids and assistant spans only (int32, ~4 MB per million tokens, no text): what a machine without the
    ShareGPT package needs to record features and train (scripts/device-train.sh)."""
    examples, num_answers = build_examples(args, out)
    torch.save({"examples": [(torch.tensor(ids, dtype=torch.int32), spans) for ids, spans in examples],
                "answers": num_answers}, path)
    print(f"{len(examples)} examples ({sum(len(i) for i, _ in examples)} tokens) -> {path}")


def collect(args, out: Path) -> dict:
    """Examples -> one teacher-forced target pass. Cached in out/data.pt."""
    cache = out / "data.pt"
    if cache.exists():
        return torch.load(cache, weights_only=False)
    source = resolve_model(args.model_path)
    examples, num_answers = build_examples(args, out)
    # eager: one pass over sequences of every length gains nothing from capturing graphs
    config = EngineConfig(model_path=args.model_path, dtype=args.dtype, max_total_tokens=args.max_len + 16,
                          enforce_eager=True)
    runner = ModelRunner(config, source, single_rank_group(torch.device(getattr(args, "device", "cpu"))))
    unpack_quantized_linears(runner.model)  # the served int4 weights at dense speed: ~2x faster at 512 rows
    blocks = list(range(runner.num_blocks))
    if args.kind == "eagle3":  # EAGLE-3 reads the low, middle and high layers' residual streams instead
        runner.model.aux_layers = set(default_aux_layers(runner.model_cfg.num_layers))
    data: dict = {"seqs": [], "feats": [], "labels": [], "masks": [], "answers": num_answers,
                  "conversations": len(examples) - num_answers, "prompt_source": args.prompts}
    for ids, spans in tqdm(examples, desc="recording features", unit="seq"):
        plan = ForwardPlan(0, ids, [(0, len(ids), blocks)], list(range(len(ids))))
        with torch.inference_mode():
            logits, hidden, aux = runner.forward(plan)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for a, b in spans:
            mask[max(a - 1, 0) : b - 1] = True  # position t predicts token t + 1
        data["seqs"].append(ids)
        feats = torch.cat(aux, dim=-1) if args.kind == "eagle3" else hidden
        data["feats"].append(feats.to(torch.bfloat16).cpu().clone())
        data["labels"].append(logits.argmax(-1).to(torch.int32).cpu())
        data["masks"].append(mask)
    torch.save(data, cache)
    return data
