"""Speculation against plain decoding at each concurrency: N clients in a closed loop, the budget deciding every step.

N clients each send their next MT-bench question as soon as the last answer ends (`spec.concurrent`), so the decode
batch holds near N; once on a plain engine and once on a speculative engine whose rank 0 budget decides every step
(`--disable-batch-size 0` by default), in plain-EAGLE-EAGLE-plain rounds. Where the ratio falls below 1 is where
`--speculative-disable-batch-size` belongs on this machine.

With `--ignore-eos` every answer runs to `--max-tokens`: the plain engine's N answers then start and end together,
one prefill step for all N, while speculation advances each sequence at its own pace, so its arrivals spread into
N prefill steps and its runs end in a tail of small batches. That measures the synchronisation rather than the step,
and reads lower than real answer lengths do.

    .venv/bin/python bench/spec_batch.py [--batches 4,8,16] [--rounds 3] [--disable-batch-size 0] [--ignore-eos]
                                         [--machine M]

Writes bench/results/spec_batch[-MACHINE].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from spec import chat_prompt, compare_concurrency, concurrent, mtbench_first_turns

from devtools.provenance import add_machine_option, provenance, result_path
from runtime.engine import Engine
from speculative.defaults import default_spec_config
from worker.config import EngineConfig, SpecConfig
from worker.model.files import fetch_default_model
from worker.sampling.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--disable-batch-size", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    add_machine_option(ap)
    args = ap.parse_args()
    fetch_default_model(quiet=True)
    spec_cfg = dataclasses.replace(
        default_spec_config(), disable_batch_size=args.disable_batch_size, calibrate_batch_limit=False
    )  # the limit asked for, at every batch size
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, ignore_eos=args.ignore_eos)
    results: dict = {
        "max_tokens": args.max_tokens,
        "disable_batch_size": args.disable_batch_size,
        "ignore_eos": args.ignore_eos,
        "requests_per_client": args.requests_per_client,
        "batches": {},
    }
    with (
        Engine(EngineConfig(dtype="bfloat16", max_total_tokens=32768, spec=SpecConfig())) as plain,
        Engine(EngineConfig(dtype="bfloat16", max_total_tokens=32768, spec=spec_cfg)) as spec,
    ):
        prompts = [chat_prompt(plain.tokenizer, q) for q in mtbench_first_turns(80)]
        for n in [int(x) for x in args.batches.split(",") if x]:
            requests = args.requests_per_client * n
            for engine in (plain, spec):  # warm-up: allocator, rank 0's estimates at this batch size
                concurrent(engine, prompts, params, n, n)
            row = compare_concurrency(plain, spec, prompts, params, n, args.rounds, requests)
            results["batches"][str(n)] = row
            print(
                f"batch {n}: plain {row['plain']:.1f} tok/s  EAGLE {row['spec']:.1f} tok/s  ({row['ratio']:.3f}x; "
                f"rounds {min(row['round_ratios']):.2f}-{max(row['round_ratios']):.2f}x; "
                f"{row['verify_steps']} verify steps)",
                flush=True,
            )
    results |= provenance()
    result_path("spec_batch", args.machine).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
