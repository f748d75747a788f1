"""Training data for `eaglegate train-draft`: examples (self-distilled answers, teacher-forced ShareGPT
conversations) and one teacher-forced target pass recording, per position, the draft's input feature, the
target's greedy next token (what a lossless verifier accepts) and whether the position is inside assistant text.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from speculative.corpus import read_all_answers
from speculative.heads import default_aux_layers
from worker.config import EngineConfig
from worker.dist import single_rank_group
from worker.model.files import resolve_model
from worker.model.layers import unpack_quantized_linears
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
    from worker.sampling.params import SamplingParams

    prompts = training_prompts(args.prompts, args.num_prompts, args.seed)
    with Engine(
        EngineConfig(model_path=args.model_path, dtype=args.dtype, max_total_tokens=65536, max_running_requests=64)
    ) as engine:
        ids = [chat_ids(engine.tokenizer, [{"role": "user", "content": p}], True)[: args.max_len - 32] for p in prompts]
        results = []
        for i in tqdm(range(0, len(ids), 64), desc="generating answers", unit="batch"):
            results += engine.generate(
                ids[i : i + 64], SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
            )
    examples = [
        ((p + r.token_ids)[: args.max_len], [(len(p), min(len(p) + len(r.token_ids), args.max_len))])
        for p, r in zip(ids, results)
    ]
    torch.save(examples, cache)
    return examples


def answer_example(prompt: list[int], answer: list[int], max_len: int) -> Example:
    """Prompt + answer as one example of at most max_len tokens. A long prompt loses its beginning (the draft learns
    from the answer and what just precedes it); an answer that would leave under 64 prompt tokens (a quarter of
    max_len, if less) loses its end."""
    answer = answer[: max_len - min(len(prompt), 64, max_len // 4)]
    prompt = prompt[len(prompt) - min(len(prompt), max_len - len(answer)) :]
    return prompt + answer, [(len(prompt), len(prompt) + len(answer))]


def distilled_prompts(tok, wanted: list[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """Chat-templated ids of ShareGPT human turns, by (conversation index, turn): turn 1 alone; turn 2 after turn 1
    and the target's own distilled answer to it (the context it would have served). [] where the text is missing."""
    from .data import sharegpt_human_turns

    turns = {t: sharegpt_human_turns(t) for t in {1} | {t for _, t in wanted}}  # turn 2 prompts quote turn 1
    first = turns[1]
    answers = read_all_answers(1) if any(t == 2 for _, t in wanted) else {}
    out = {}
    for i, t in wanted:
        if t == 1:
            msgs = [{"role": "user", "content": first[i]}] if first[i] else []
        elif t == 2 and first[i] and turns[2][i] and answers.get(i):
            msgs = [
                {"role": "user", "content": first[i]},
                {"role": "assistant", "content": tok.decode(answers[i], skip_special_tokens=True).strip()},
                {"role": "user", "content": turns[2][i]},
            ]
        else:
            msgs = []
        out[(i, t)] = chat_ids(tok, msgs, True) if msgs else []
    return out


def distilled_examples(args) -> list[Example]:
    """The committed answers of `eaglegate distill` and of the GPU runner (speculative/answers/distilled*/), first
    and second turns, each after its ShareGPT prompt rendered with the chat template."""
    from worker.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.model_path))
    answers = {(i, t): a for t in (1, 2) for i, a in read_all_answers(t).items() if a}
    prompts = distilled_prompts(tok, sorted(answers))
    examples = [
        answer_example(prompts[key], answers[key], args.max_len)
        for key in tqdm(sorted(answers), desc="distilled answers", unit="answer")
        if prompts[key]
    ]
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
        saved = [torch.load(f, weights_only=False) for f in args.examples]
        return (
            [(ids.tolist(), spans) for s in saved for ids, spans in s["examples"]],
            sum(s["answers"] for s in saved),
        )
    examples = generate_answers(args, out)
    num_answers = len(examples)
    if args.conversations:
        from worker.model.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model(args.model_path))
        convs = sharegpt_conversations(args.conversations, args.seed)
        examples += [conversation_example(tok, c, args.max_len) for c in tqdm(convs, desc="rendering", unit="conv")]
    return [(ids, spans) for ids, spans in examples if spans and len(ids) > 8], num_answers


def export_examples(args, out: Path, path: Path) -> None:
    """Token ids and assistant spans only (int32, ~4 MB per million tokens, no text): what a host without the
    ShareGPT package needs to record features and train (`--examples`)."""
    examples, num_answers = build_examples(args, out)
    torch.save(
        {
            "examples": [(torch.tensor(ids, dtype=torch.int32), spans) for ids, spans in examples],
            "answers": num_answers,
        },
        path,
    )
    print(f"{len(examples)} examples ({sum(len(i) for i, _ in examples)} tokens) -> {path}")


PART_TOKENS = 1 << 18  # tokens per part of the feature cache: 0.9 GB of EAGLE-3 features, what recording holds
LISTS = ("seqs", "feats", "labels", "masks")
SOFT_LISTS = ("soft_ids", "soft_p")


def collect(args, out: Path) -> dict:
    """Examples -> one teacher-forced target pass, recorded in parts under out/features/ (unless --no-data-cache)
    and read back memory-mapped, so the features (12 GB for 3.4M tokens) live in the page cache. A finished
    recording is used as it is; an interrupted one resumes after its last whole part once its examples and settings
    match. A single-file out/data.pt is read instead."""
    legacy = out / "data.pt"
    if legacy.exists():
        return torch.load(legacy, weights_only=False, mmap=True)
    folder = out / "features"
    record = folder / "recording.json"
    held = json.loads(record.read_text()) if record.exists() else None
    if held and held.get("complete"):
        return _read_parts(folder, held["data"], _done(folder))
    examples, num_answers = build_examples(args, out)
    soft_k = getattr(args, "soft_topk", 0)
    data: dict = {"answers": num_answers, "conversations": len(examples) - num_answers, "prompt_source": args.prompts}
    if soft_k:  # the target's distribution, its top-K (EAGLE's loss reads the whole of it; K keeps the cache small)
        data["soft_topk"] = soft_k
    lists = LISTS + (SOFT_LISTS if soft_k else ())
    if getattr(args, "no_data_cache", False):
        data |= {name: [] for name in lists}
        for group in _record(args, examples, lists):
            for name in lists:
                data[name] += group[name]
        return data
    folder.mkdir(exist_ok=True)
    meta = {"data": data, "examples": _fingerprint(args, examples), "complete": False}
    if held and held["examples"] != meta["examples"]:
        diff = "; ".join(
            f"{k}: recorded {held['examples'].get(k)!r}, asked {v!r}"
            for k, v in meta["examples"].items()
            if held["examples"].get(k) != v
        )
        raise SystemExit(
            f"{folder} holds part of a recording of other examples or settings ({diff}): pass the "
            f"same ones to finish it, or record into a new --out"
        )
    _write_json(record, meta)
    done = _done(folder)
    part, first = {name: [] for name in lists}, done
    for group in _record(args, examples[done:], lists, done, len(examples)) if done < len(examples) else ():
        for name in lists:
            part[name] += group[name]
        if sum(len(ids) for ids in part["seqs"]) >= getattr(args, "part_tokens", PART_TOKENS) or first + len(
            part["seqs"]
        ) == len(examples):
            path = folder / f"part-{first:07d}-{len(part['seqs']):06d}.pt"
            _write_whole(path, lambda tmp, part=part: torch.save(part, tmp))
            first += len(part["seqs"])
            part = {name: [] for name in lists}
    _write_json(record, meta | {"complete": True})
    return _read_parts(folder, data, len(examples))


def _done(folder: Path) -> int:
    """Sequences the parts hold, after checking that each part starts where the one before it ended."""
    done = 0
    for path in sorted(folder.glob("part-*.pt")):
        first, count = map(int, path.stem.split("-")[1:])
        if first != done:
            raise SystemExit(
                f"{folder}: {path.name} starts at sequence {first}, but the parts before it end at {done} "
                f"(a part is missing): record into a new --out"
            )
        done += count
    return done


def _read_parts(folder: Path, data: dict, count: int) -> dict:
    out = dict(data) | {name: [] for name in LISTS + (SOFT_LISTS if data.get("soft_topk") else ())}
    for path in sorted(folder.glob("part-*.pt")):
        for name, values in torch.load(path, weights_only=False, mmap=True).items():
            out[name].extend(values)
    assert len(out["seqs"]) == count, f"{folder}: the parts hold {len(out['seqs'])} sequences, not {count}"
    return out


def _write_json(path: Path, value: dict) -> None:
    _write_whole(path, lambda tmp: tmp.write_text(json.dumps(value, indent=1)))


def _write_whole(path: Path, write) -> None:
    """write(temporary path), then a rename: the file is there whole or not at all."""
    tmp = path.with_suffix(".tmp")
    write(tmp)
    tmp.replace(path)


def _fingerprint(args, examples: list[Example]) -> dict:
    ids = torch.tensor([t for e, _ in examples for t in e], dtype=torch.int64)
    spans = torch.tensor([x for _, sp in examples for a, b in sp for x in (a, b)], dtype=torch.int64)
    # what changes a feature's bits: the examples, the model and dtype, the device, and which sequences share a forward
    return {
        "count": len(examples),
        "tokens": len(ids),
        "kind": args.kind,
        "model": str(args.model_path),
        "dtype": args.dtype,
        "soft_topk": getattr(args, "soft_topk", 0),
        "device": str(getattr(args, "device", "cpu")),
        "record_tokens": getattr(args, "record_tokens", 0),
        "sha256": hashlib.sha256(ids.numpy().tobytes() + spans.numpy().tobytes()).hexdigest(),
    }


def _record(args, examples: list[Example], lists: tuple[str, ...], done: int = 0, total: int = 0):
    """Per group of examples sharing one forward: its per-sequence ids, features, labels, masks (and soft labels)."""
    source = resolve_model(args.model_path)
    device = torch.device(getattr(args, "device", "cpu"))
    # sequences share a forward up to 8,192 tokens on a GPU (one each is launch-bound there), --max-len on the CPU
    budget = getattr(args, "record_tokens", 0) or (8192 if device.type == "cuda" else args.max_len)
    budget = max(budget, args.max_len)
    # eager: one pass over sequences of every length gains nothing from capturing graphs
    config = EngineConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        attention_backend="torch",
        max_total_tokens=2 * budget + 64,
        enforce_eager=True,
    )  # partial blocks
    runner = ModelRunner(config, source, single_rank_group(device))
    unpack_quantized_linears(runner.model)  # the served int4 weights at dense speed: ~2x faster at 512 rows
    if args.kind == "eagle3":  # EAGLE-3 reads the low, middle and high layers' residual streams instead
        runner.model.aux_layers = set(default_aux_layers(runner.model_cfg.num_layers))
    soft_k = getattr(args, "soft_topk", 0)
    # on a GPU with nothing to write, the features stay there (11.7 GB for 3.4M tokens): training then builds
    # its batches on the device instead of copying them from host memory every step
    keep_on_device = device.type == "cuda" and getattr(args, "no_data_cache", False)
    bar = tqdm(total=total or len(examples), initial=done, desc="recording features", unit="seq")
    for group in _token_groups(examples, budget):
        plan, free = ForwardPlan(0), 0
        for ids, _ in group:
            n = -(-len(ids) // runner.block_size)
            plan.seqs.append((0, len(ids), list(range(free, free + n))))
            plan.input_ids += ids
            free += n
        plan.sample_rows = list(range(len(plan.input_ids)))
        with torch.inference_mode():
            logits, hidden, aux = runner.forward(plan)
            feats = torch.cat(aux, dim=-1) if args.kind == "eagle3" else hidden
            labels = logits.argmax(-1).to(torch.int32).cpu()
            if soft_k:
                soft_p, soft_ids = torch.softmax(logits.float(), dim=-1).topk(soft_k, dim=-1)
                soft_p, soft_ids = soft_p.to(torch.float16).cpu(), soft_ids.to(torch.int32).cpu()
            feats = feats.to(torch.bfloat16)
            if not keep_on_device:
                feats = feats.cpu()
        start, out = 0, {name: [] for name in lists}
        for ids, spans in group:
            end = start + len(ids)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            for a, b in spans:
                mask[max(a - 1, 0) : b - 1] = True  # position t predicts token t + 1
            out["seqs"].append(ids)
            out["feats"].append(feats[start:end].clone())
            out["labels"].append(labels[start:end].clone())
            out["masks"].append(mask)
            if soft_k:
                out["soft_ids"].append(soft_ids[start:end].clone())
                out["soft_p"].append(soft_p[start:end].clone())
            start = end
        bar.update(len(group))
        yield out
    bar.close()


def _token_groups(examples: list[Example], budget: int):
    """Consecutive examples, at most `budget` tokens per group (at least one example each)."""
    group: list[Example] = []
    tokens = 0
    for ex in examples:
        if group and tokens + len(ex[0]) > budget:
            yield group
            group, tokens = [], 0
        group.append(ex)
        tokens += len(ex[0])
    if group:
        yield group
