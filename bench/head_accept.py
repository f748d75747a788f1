"""A draft head's own acceptance, as `test_shipped_head.py` measures it, for several heads in one run.

Float32 (deterministic), a fixed tree (5 steps, top-4, 12 tokens, every step drafted: no cost table, no context
candidates), batch 1: the test's 4 questions x 64 tokens and 8 questions x 128 tokens. Compares heads (say, a newly
trained one against the shipped one) on what the test's floor reads, apart from the served benchmark's budget and
context drafts.

    .venv/bin/python bench/head_accept.py [HEAD ...] [--machine M]   (default: the shipped head)

Writes bench/results/head_accept[-MACHINE].json.
"""

from __future__ import annotations

import argparse
import json

from devtools.prompts import QUESTIONS, chat, fixed_tree
from devtools.provenance import add_machine_option, provenance, result_path
from runtime.engine import Engine  # noqa: E402
from speculative.defaults import DEFAULT_HEAD  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402

MORE = [
    "How do I make a good cup of coffee?",
    "Summarize the causes of World War I.",
    "Write a Python function that reverses a linked list.",
    "What is the difference between a virus and a bacterium?",
]
SETS = {"test: 4 questions x 64": (QUESTIONS, 64), "8 questions x 128": (QUESTIONS + MORE, 128)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="*", default=[str(DEFAULT_HEAD)])
    add_machine_option(ap)
    args = ap.parse_args()
    with Engine(EngineConfig(dtype="float32", max_total_tokens=8192)) as eng:
        prompts = {k: [eng.encode(chat(eng, q)) for q in qs] for k, (qs, _) in SETS.items()}
        refs = {
            k: [r.token_ids for r in eng.generate(prompts[k], SamplingParams(max_new_tokens=n, temperature=0))]
            for k, (_, n) in SETS.items()
        }
    results = []
    for head in args.heads:
        row = {"head": head}
        with Engine(EngineConfig(dtype="float32", max_total_tokens=8192, spec=fixed_tree(head))) as eng:
            for k, (_, n) in SETS.items():
                before = eng.stats.values
                params = SamplingParams(max_new_tokens=n, temperature=0)
                out = [eng.generate([p], params)[0].token_ids for p in prompts[k]]  # batch 1, as the test
                after = eng.stats.values
                steps = after["spec_verify_steps"] - before.get("spec_verify_steps", 0)
                accepted = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
                row[k] = {
                    "tau": round((steps + accepted) / steps, 3),
                    "verify_steps": steps,
                    "identical": sum(a == b for a, b in zip(out, refs[k])),
                    "of": len(out),
                }
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {**provenance(), "tree": "s5 k4 n12, float32, no context candidates", "results": results}
    result_path("head_accept", args.machine).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
