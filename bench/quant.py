"""Quantized fast step against llama.cpp: single-stream greedy tok/s on MT-bench first turns for plain decode with
--quantization none, int8 and auto, the default serve (auto with EAGLE and the shipped head), and llama.cpp on the
same GGUF with 2 threads; concurrency 4 and 16; peak resident memory of each worker process.

    .venv/bin/python bench/quant.py [--limit 80] [--max-tokens 128] [--machine M]   (make bench-quant)

All engines are loaded at once and measured question by question in rotating order, so machine noise hits each
alike; llama.cpp runs after them on the same questions. Writes bench/results/quant[-MACHINE].json with the command
and commit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from spec import LLAMA_ANCHOR, chat_prompt, concurrent, llama_cpp_tok_s, mtbench_first_turns

from devtools.provenance import add_machine_option, provenance, result_path
from runtime.engine import Engine
from speculative.defaults import default_spec_config
from worker.config import EngineConfig, SpecConfig
from worker.model.files import GGUF_NAME, fetch_default_model
from worker.sampling.params import SamplingParams

KV_TOKENS = 16384


def peak_rss_mib(pid: int) -> float:
    """VmHWM: the most memory the process ever had resident."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def runtime_baseline_mib() -> float:
    """Peak RSS of a process that imports what a worker imports and loads no model: the runtime's own share."""
    code = "import torch, worker.runner, worker.leader, speculative.leader; print(open('/proc/self/status').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="each concurrency level sends this many questions per client, refilled as answers end",
    )
    add_machine_option(ap)
    args = ap.parse_args()
    folder = fetch_default_model(quiet=True)
    questions = mtbench_first_turns(args.limit)
    base = EngineConfig(dtype="bfloat16", max_total_tokens=KV_TOKENS, spec=SpecConfig())
    configs = {
        "plain none": base.replace(quantization="none"),
        "plain int8": base.replace(quantization="int8"),
        "plain auto": base.replace(quantization="auto"),
        "default (auto + EAGLE)": base.replace(quantization="auto", spec=default_spec_config()),
    }
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0)
    engines = {name: Engine(cfg) for name, cfg in configs.items()}
    results: dict = {"limit": args.limit, "max_tokens": args.max_tokens, "engines": {}, "concurrency": {}}
    try:
        tok = engines["plain auto"].tokenizer
        prompts = [chat_prompt(tok, q) for q in questions]
        names = list(engines)
        secs, toks, outs = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {n: [] for n in names}
        for name in names:  # warm-up
            engines[name].generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=0))
        before = dict(engines["default (auto + EAGLE)"].stats.values)
        for i, ids in enumerate(prompts):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                r = engines[name].generate([ids], params)[0]
                secs[name] += time.perf_counter() - t0
                toks[name] += len(r.token_ids)
                outs[name].append(r.token_ids)
            if (i + 1) % 10 == 0:
                print(
                    f"{i + 1}/{len(prompts)}: " + "  ".join(f"{n} {toks[n] / secs[n]:.1f}" for n in names), flush=True
                )
        after = engines["default (auto + EAGLE)"].stats.values
        steps = after.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0)
        accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
        for name in names:
            results["engines"][name] = {
                "tok_s": toks[name] / secs[name],
                "tokens": toks[name],
                "peak_rss_mib": peak_rss_mib(engines[name]._procs[0].pid),
            }
        results["engines"]["default (auto + EAGLE)"]["tau"] = (steps + accepted) / max(steps, 1)
        results["identical_default_vs_plain_auto"] = sum(
            a == b for a, b in zip(outs["default (auto + EAGLE)"], outs["plain auto"])
        )
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            row = {
                name: concurrent(engines[name], prompts, params, c, args.requests_per_client * c)
                for name in ("plain auto", "default (auto + EAGLE)")
            }
            results["concurrency"][str(c)] = row
            print(f"concurrency {c}: " + "  ".join(f"{k} {v:.1f} tok/s" for k, v in row.items()), flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()
    lc = llama_cpp_tok_s(questions, args.max_tokens)
    results["llama_cpp_tok_s"] = lc
    results["llama_cpp"] = LLAMA_ANCHOR
    gguf_mib = (folder / GGUF_NAME).stat().st_size / 2**20
    results["memory"] = {
        "gguf_mib": gguf_mib,
        "runtime_baseline_mib": runtime_baseline_mib(),
        "kv_pool_tokens": KV_TOKENS,
    }
    e = results["engines"]
    auto, default = e["plain auto"]["tok_s"], e["default (auto + EAGLE)"]["tok_s"]
    ratios = {
        "auto / none": auto / e["plain none"]["tok_s"],
        "int8 / none": e["plain int8"]["tok_s"] / e["plain none"]["tok_s"],
        "default / plain auto": default / auto,
    }
    if lc:
        ratios |= {"plain auto / llama.cpp": auto / lc, "default / llama.cpp": default / lc}
    for c, row in results["concurrency"].items():
        ratios[f"plain auto concurrency {c} / single-stream"] = row["plain auto"] / auto
        ratios[f"default concurrency {c} / single-stream"] = row["default (auto + EAGLE)"] / default
    results["ratios"] = ratios
    results |= provenance()
    path = result_path("quant", args.machine)
    path.write_text(json.dumps(results, indent=2))
    for name, r in e.items():
        print(f"{name}: {r['tok_s']:.1f} tok/s, worker peak RSS {r['peak_rss_mib']:.0f} MiB")
    print(f"llama.cpp: {lc:.1f} tok/s" if lc else "llama.cpp: llama-server not built (make bench-quant builds it)")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"identical outputs, default vs plain auto: {results['identical_default_vs_plain_auto']}/{len(prompts)}")
    print(f"results in {path}")


if __name__ == "__main__":
    main()
