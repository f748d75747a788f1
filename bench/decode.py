"""Decode throughput: eaglegate vs transformers `generate`, same model and dtype, measured in one run.

    .venv/bin/python bench/decode.py [--dtype bfloat16] [--new-tokens 128] [--concurrency 1,4,16]   (make bench)

Prints tokens/s of each and the ratios; writes no results file (machines drift: compare within one run only).
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime.engine import Engine
from worker.config import EngineConfig
from worker.model.files import GGUF_NAME, fetch_default_model
from worker.sampling.params import SamplingParams

PROMPT = "Write a detailed essay about the history of the printing press and its effect on Europe."


def bench_engine(engine: Engine, prompt_ids: list[int], concurrency: int, new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate([prompt_ids], SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
    t0 = time.perf_counter()
    out = engine.generate([prompt_ids] * concurrency, params)
    dt = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in out) / dt


def bench_transformers(folder, dtype: torch.dtype, prompt_ids: list[int], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=GGUF_NAME, dtype=dtype).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    folder = fetch_default_model(quiet=True)
    with Engine(EngineConfig(dtype=args.dtype, max_total_tokens=16384)) as engine:
        prompt_ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(prompt_ids, list):
            prompt_ids = prompt_ids["input_ids"]
        results = {
            c: bench_engine(engine, prompt_ids, c, args.new_tokens) for c in map(int, args.concurrency.split(","))
        }
    hf = (
        None
        if args.skip_transformers
        else bench_transformers(folder, getattr(torch, args.dtype), prompt_ids, args.new_tokens)
    )
    single = results.get(1)
    print(
        f"model smollm2-135m-instruct  dtype {args.dtype}  new tokens {args.new_tokens}  threads "
        f"{torch.get_num_threads()}"
    )
    for c, tps in results.items():
        extra = f"  ({tps / single:.2f}x single-stream)" if single and c != 1 else ""
        print(f"eaglegate concurrency {c:>3}: {tps:8.1f} tok/s{extra}")
    if hf is not None:
        print(f"transformers generate   1: {hf:8.1f} tok/s")
        if single:
            print(f"ratio eaglegate/transformers single-stream: {single / hf:.2f}x")


if __name__ == "__main__":
    main()
