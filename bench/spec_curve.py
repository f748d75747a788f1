"""Accept length and speedup per training checkpoint: each head `train-draft` exported under OUT/heads/step-N
(plus the head it started from), served with the default tree on MT-bench first turns, against plain decoding in
the same run; the held-out accept length from OUT/curve.json beside it. Writes JSON and a PNG.

    .venv/bin/python bench/spec_curve.py TRAIN_OUT [--init HEAD] [--questions 10] [--max-tokens 128] [--machine M]

Fewer questions than bench/spec.py: this shows where training flattens; bench/spec.py gives the headline figures.
Writes bench/results/spec_curve[-MACHINE].json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from spec import chat_prompt, mtbench_first_turns, pyplot, single_stream, spec_config

from devtools.provenance import add_machine_option, provenance, result_path
from runtime.engine import Engine
from speculative.defaults import default_spec_config
from worker.config import EngineConfig, SpecConfig


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    points = results["checkpoints"]
    steps = [p["step"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [p["tau"] for p in points], "o-", color="tab:green", label="MT-bench accept length (served)")
    held = results.get("heldout_curve") or []
    if held:
        ax.plot(
            [c["step"] for c in held],
            [c["heldout_tau"] for c in held],
            "s--",
            color="tab:olive",
            label="held-out accept length (3-step chain)",
        )
    ax.set_xlabel("training step (0: the warm-start head)")
    ax.set_ylabel("tokens per verify step")
    ax2 = ax.twinx()
    ax2.plot(steps, [p["speedup"] for p in points], "^:", color="tab:blue", label="speedup vs plain")
    ax2.set_ylabel("speedup (batch 1)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower right")
    ax.set_title("EAGLE-3 head by checkpoint")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("train_out", help="a train-draft --out folder (heads/step-N, curve.json)")
    ap.add_argument("--init", default=None, help="the head training started from (plotted as step 0)")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", default=None, help="only these checkpoints, e.g. 100,300,700 (default: all)")
    add_machine_option(ap)
    args = ap.parse_args()
    out = Path(args.train_out)
    heads = [(0, Path(args.init))] if args.init else []
    heads += [(int(p.name.split("-")[1]), p) for p in sorted((out / "heads").glob("step-*"))]
    if args.steps:
        keep = {0, *map(int, args.steps.split(","))}
        heads = [(step, head) for step, head in heads if step in keep]
    d = default_spec_config()
    tree = (d.num_steps, d.eagle_topk, d.num_draft_tokens)
    questions = mtbench_first_turns(args.questions)
    results: dict = {
        "checkpoints": [],
        "questions": args.questions,
        "max_tokens": args.max_tokens,
        "tree": "s{} k{} n{}".format(*tree),
    }
    curve = out / "curve.json"
    if curve.exists():
        results["heldout_curve"] = json.loads(curve.read_text())
    # no prefix cache: the plain engine sees every prompt once per head, and in bfloat16 a cached prompt's last
    # block, recomputed as a short extend, rounds differently from the full prefill a fresh engine runs
    base = EngineConfig(dtype="bfloat16", max_total_tokens=16384, disable_radix_cache=True)
    with Engine(dataclasses.replace(base, spec=SpecConfig())) as plain:
        prompts = [chat_prompt(plain.tokenizer, q) for q in questions]
        for step, head in heads:
            with Engine(dataclasses.replace(base, spec=spec_config(str(head), tree, d.disable_batch_size))) as spec:
                r = single_stream(plain, spec, prompts, args.max_tokens)
            src = r["sources"]
            point = {
                "step": step,
                "head": str(head),
                "tau": r["tau"],
                "speedup": r["speedup"],
                "plain_tok_s": r["plain_tok_s"],
                "spec_tok_s": r["spec_tok_s"],
                "identical": r["identical"],
                "eagle_accepted": src["spec_eagle_accepted_tokens"],
                "eagle_tokens": src["spec_eagle_tokens"],
            }
            results["checkpoints"].append(point)
            print(
                f"step {step}: tau {r['tau']:.2f}, {r['speedup']:.2f}x plain, EAGLE accepted "
                f"{point['eagle_accepted']}/{point['eagle_tokens']}, identical {r['identical']}/{r['n']}",
                flush=True,
            )
    results |= provenance()
    path = result_path("spec_curve", args.machine)
    path.write_text(json.dumps(results, indent=2))
    plot(results, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
