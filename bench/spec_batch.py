"""Speculation against plain decoding at fixed decode batch sizes, in plain-EAGLE-EAGLE-plain rounds.

The first N MT-bench questions decode together to 256 tokens (EOS ignored, so the batch stays N throughout), once
on a plain engine and once on a speculative engine whose rank 0 budget decides every step (`--disable-batch-size 0`
by default). Where `bench/spec.py`'s concurrency columns only speculate in a batch's tail, this measures what the
budget does at each batch size; it chose `--speculative-disable-batch-size`.

    .venv/bin/python bench/spec_batch.py [--batches 4,8,16] [--rounds 3] [--disable-batch-size 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from provenance import provenance
from spec import chat_prompt, mtbench_first_turns

from runtime.engine import Engine
from speculative.defaults import default_spec_config
from worker.config import EngineConfig, SpecConfig
from worker.model_files import fetch_default_model
from worker.sampling import SamplingParams

OUT = Path(__file__).parent / "results"


def tok_s(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(len(r.token_ids) for r in out) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--disable-batch-size", type=int, default=0)
    ap.add_argument("--name", default="spec_batch")
    args = ap.parse_args()
    fetch_default_model(quiet=True)
    spec_cfg = dataclasses.replace(default_spec_config(), disable_batch_size=args.disable_batch_size)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    results: dict = {"max_tokens": args.max_tokens, "disable_batch_size": args.disable_batch_size, "batches": {}}
    with Engine(EngineConfig(dtype="bfloat16", max_total_tokens=32768, spec=SpecConfig())) as plain, \
            Engine(EngineConfig(dtype="bfloat16", max_total_tokens=32768, spec=spec_cfg)) as spec:
        questions = mtbench_first_turns(80)
        for n in [int(x) for x in args.batches.split(",") if x]:
            prompts = [chat_prompt(plain.tokenizer, q) for q in questions[:n]]
            tok_s(plain, prompts, params), tok_s(spec, prompts, params)  # warm-up: allocator, rank 0's estimates
            before = spec.stats.values
            plains, specs, ratios = [], [], []
            for _ in range(args.rounds):
                p1 = tok_s(plain, prompts, params)
                s = [tok_s(spec, prompts, params) for _ in range(2)]
                p2 = tok_s(plain, prompts, params)
                plains += [p1, p2]
                specs += s
                ratios.append(sum(s) / (p1 + p2))
            after = spec.stats.values
            row = {"plain_tok_s": sum(plains) / len(plains), "spec_tok_s": sum(specs) / len(specs),
                   "ratio": sum(ratios) / len(ratios), "round_ratios": [round(r, 4) for r in ratios],
                   "verify_steps": after.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0)}
            results["batches"][str(n)] = row
            print(f"batch {n}: plain {row['plain_tok_s']:.1f} tok/s  EAGLE {row['spec_tok_s']:.1f} tok/s  "
                  f"({row['ratio']:.3f}x; rounds {min(ratios):.2f}-{max(ratios):.2f}x; "
                  f"{row['verify_steps']} verify steps)", flush=True)
    results |= provenance()
    OUT.mkdir(exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
