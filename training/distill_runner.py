"""Self-distillation on one GPU without the serving stack: greedy answers batched straight through the model runner.
Its own batcher, not worker/scheduler.py: each row reserves its blocks up front, so nothing preempts.

    python -m training.distill_runner --export-prompts prompts.pt
    python -m training.distill_runner --prompts prompts.pt --out answers.jsonl.gz [--device cuda] [--seconds S]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from speculative.corpus import read_all_answers
from worker.config import DEFAULT_MODEL, EngineConfig
from worker.dist import single_rank_group
from worker.model.files import resolve_model
from worker.protocol import ForwardPlan
from worker.runner import ModelRunner

from .train_data import answer_example


@dataclass
class Row:
    """One prompt being answered: its blocks are reserved for prompt + answer up front, so a row never waits."""

    index: object  # the caller's key for this prompt
    prompt: list[int]
    blocks: list[int]
    answer: list[int] = field(default_factory=list)


def greedy_answers(
    runner: ModelRunner,
    prompts: list[tuple[object, list[int]]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    max_rows: int,
    deadline: float = float("inf"),
    on_done=None,
    prefill_tokens: int = 8192,
) -> dict:
    """Greedy answers for (index, prompt ids) pairs, up to max_rows decoding at once; finished rows are refilled
    from the queue. After `deadline` (time.monotonic) no new prompt starts; rows already running finish. Each
    answer ends at an EOS token (kept) or at max_new_tokens. on_done(index, answer) is called as each finishes.
    Prompts are prefilled together up to prefill_tokens per forward."""
    bs = runner.block_size
    free = list(range(runner.num_blocks - 1, -1, -1))
    queue = list(reversed(prompts))
    running: list[Row] = []
    done: dict = {}
    step = 0

    def finish(row: Row) -> None:
        done[row.index] = row.answer
        free.extend(row.blocks)
        if on_done is not None:
            on_done(row.index, row.answer)

    while queue or running:
        admitted: list[Row] = []
        tokens = 0
        while queue and len(running) + len(admitted) < max_rows and time.monotonic() < deadline:
            index, ids = queue[-1]
            need = -(-(len(ids) + max_new_tokens) // bs)
            if need > len(free) or (admitted and tokens + len(ids) > prefill_tokens):
                break
            queue.pop()
            admitted.append(Row(index, ids, [free.pop() for _ in range(need)]))
            tokens += len(ids)
        if not admitted and not running:
            if queue and time.monotonic() < deadline:
                raise ValueError(f"a prompt of {len(queue[-1][1])} tokens does not fit {runner.num_blocks} blocks")
            break
        if admitted:  # prefill plans apart from decode plans: a mixed plan's mask would span every row
            rows, plan = (
                admitted,
                ForwardPlan(
                    step, [t for r in admitted for t in r.prompt], [(0, len(r.prompt), r.blocks) for r in admitted]
                ),
            )
        else:
            rows, plan = (
                running,
                ForwardPlan(
                    step,
                    [r.answer[-1] for r in running],
                    [(len(r.prompt) + len(r.answer) - 1, 1, r.blocks) for r in running],
                ),
            )
        plan.sample_rows = [end - 1 for end in accumulate(q_len for _, q_len, _ in plan.seqs)]  # each one's last row
        logits, _, _ = runner.forward(plan)
        step += 1
        for row, token in zip(rows, logits.argmax(-1).tolist()):
            row.answer.append(token)
        if admitted:
            running += admitted
        still = []
        for row in running:
            if row.answer[-1] in eos_ids or len(row.answer) >= max_new_tokens:
                finish(row)
            else:
                still.append(row)
        running = still
    return done


def export_prompts(path: Path, max_prompt_tokens: int, model_path: str = DEFAULT_MODEL) -> None:
    """The chat-templated token ids of every ShareGPT first turn not answered yet, and of every second turn whose
    first has an answer (after it), not answered yet. An empty list where the text is missing or longer than
    max_prompt_tokens: recorded with no answer, as `eaglegate distill` does."""
    from worker.model.tokenizer import load_tokenizer

    from .data import sharegpt_human_turns
    from .train_data import distilled_prompts

    tok = load_tokenizer(resolve_model(model_path))
    n = len(sharegpt_human_turns(1))
    first, second = read_all_answers(1), read_all_answers(2)
    wanted = [(i, 1) for i in range(n) if i not in first]
    wanted += [(i, 2) for i in range(n) if first.get(i) and i not in second]
    prompts = distilled_prompts(tok, wanted)
    ids = [torch.tensor(x if len(x) <= max_prompt_tokens else [], dtype=torch.int32) for x in prompts.values()]
    torch.save(
        {
            "index": [i for i, _ in prompts],
            "turn": [t for _, t in prompts],
            "ids": ids,
            "max_prompt_tokens": max_prompt_tokens,
        },
        path,
    )
    for t in (1, 2):
        sel = [x for (_, tt), x in zip(prompts, ids) if tt == t]
        print(
            f"turn {t}: {len(sel)} prompts ({sum(len(x) for x in sel)} tokens, {sum(len(x) == 0 for x in sel)} "
            f"unusable)"
        )
    print(f"-> {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m training.distill_runner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--export-prompts", default=None, help="write the unanswered prompts' token ids here and stop")
    p.add_argument("--prompts", default=None, help="token ids written by --export-prompts")
    p.add_argument("--out", default=None, help="answers as gzip JSON lines (appended as they finish)")
    p.add_argument("--examples-out", default=None, help="also save prompt + answer as training examples")
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1024, help="rows decoding at once")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-len", type=int, default=512, help="tokens per training example (--examples-out)")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="prompt tokens per prefill forward")
    p.add_argument("--seconds", type=float, default=0, help="start no prompt after this long (0: no limit)")
    args = p.parse_args(argv)
    if args.export_prompts:
        export_prompts(Path(args.export_prompts), args.max_prompt_tokens, args.model_path)
        return 0
    if not args.prompts or not args.out:
        p.error("--prompts and --out are required (or --export-prompts)")
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    saved = torch.load(args.prompts, weights_only=False)
    # a row's key is (conversation index, human turn); the answers are keyed the same way
    pairs = [
        ((i, t), x.tolist())
        for i, t, x in zip(saved["index"], saved.get("turn", [1] * len(saved["index"])), saved["ids"])
    ]
    # shortest first: prefill forwards hold prompts of like length (their masks span the longest), and a time box
    # leaves the longest prompts, whose examples are cut the most, for later
    usable = sorted(((k, x) for k, x in pairs if x), key=lambda kx: len(kx[1]))
    t0 = time.monotonic()
    # eager, reference attention: one process and plain torch ops, the path every test covers on CPU
    config = EngineConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        enforce_eager=True,
        attention_backend="torch",
        max_total_tokens=args.batch * (args.max_prompt_tokens + args.max_new_tokens + 32),
    )
    runner = ModelRunner(config, resolve_model(args.model_path), single_rank_group(device))
    eos = tuple(runner.model_cfg.eos_token_ids)
    print(
        f"{len(usable)} prompts to answer on {device} ({runner.num_blocks} blocks), loaded in "
        f"{time.monotonic() - t0:.0f} s",
        flush=True,
    )
    out = gzip.open(args.out, "at")

    def record(key: tuple[int, int], answer: list[int]) -> str:
        return (
            json.dumps(
                {"i": key[0]} | ({"turn": key[1]} if key[1] != 1 else {}) | {"ids": answer}, separators=(",", ":")
            )
            + "\n"
        )

    for key, x in pairs:
        if not x:  # recorded with no answer, as `eaglegate distill` does, so no later run retries it
            out.write(record(key, []))
    finished: list[int] = []  # each finished answer's length

    def on_done(key: tuple[int, int], answer: list[int]) -> None:
        out.write(record(key, answer))
        finished.append(len(answer))
        if len(finished) % 500 == 0:
            out.flush()
            print(f"{len(finished)} answers, {sum(finished) / (time.monotonic() - t1):.0f} tok/s", flush=True)

    t1 = time.monotonic()
    with torch.inference_mode():
        answers = greedy_answers(
            runner,
            usable,
            args.max_new_tokens,
            eos,
            args.batch,
            t1 + args.seconds if args.seconds else float("inf"),
            on_done,
            args.prefill_tokens,
        )
    out.close()
    dt = time.monotonic() - t1
    print(
        f"{len(answers)} of {len(usable)} answers, {sum(finished)} tokens in {dt:.0f} s "
        f"({sum(finished) / max(dt, 1e-9):.0f} tok/s)",
        flush=True,
    )
    if args.examples_out:
        prompt_of = dict(usable)
        examples = []
        for i, a in answers.items():
            ids, spans = answer_example(prompt_of[i], a, args.max_len)
            if spans[0][0] < spans[0][1] and len(ids) > 8:
                examples.append((torch.tensor(ids, dtype=torch.int32), spans))
        torch.save({"examples": examples, "answers": len(examples)}, args.examples_out)
        print(f"{len(examples)} examples -> {args.examples_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
