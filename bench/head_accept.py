"""A draft head's own acceptance, as `tests/test_shipped_head.py` measures it, for several heads in one run.

Float32 (deterministic), a fixed tree (5 steps, top-4, 12 tokens, every step drafted: no cost table, no context
candidates), batch 1: the test's 4 questions x 64 tokens and 8 questions x 128 tokens. Compares heads (say, a new
stage against the shipped one) on what the test floor reads, apart from the served benchmark's budget and context
drafts.

    .venv/bin/python bench/head_accept.py [HEAD ...]   (default: the shipped head)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import chat  # noqa: E402
from test_shipped_head import QUESTIONS  # noqa: E402

from runtime.engine import Engine  # noqa: E402
from server.cli import add_engine_args  # noqa: E402
from speculative.defaults import DEFAULT_HEAD, resolve_spec_config  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402

MORE = ["How do I make a good cup of coffee?", "Summarize the causes of World War I.",
        "Write a Python function that reverses a linked list.",
        "What is the difference between a virus and a bacterium?"]
SETS = {"test: 4 questions x 64": (QUESTIONS, 64), "8 questions x 128": (QUESTIONS + MORE, 128)}


def fixed_tree(head: str):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return resolve_spec_config(p.parse_args([
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head, "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "12", "--speculative-cost-table", "off",
        "--speculative-context-tokens", "0"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="*", default=[str(DEFAULT_HEAD)])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "head_accept.json"))
    args = ap.parse_args()
    with Engine(EngineConfig(dtype="float32", max_total_tokens=8192)) as eng:
        prompts = {k: [eng.encode(chat(eng, q)) for q in qs] for k, (qs, _) in SETS.items()}
        refs = {k: [r.token_ids for r in eng.generate(prompts[k], SamplingParams(max_new_tokens=n, temperature=0))]
                for k, (_, n) in SETS.items()}
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
                row[k] = {"tau": round((steps + accepted) / steps, 3), "verify_steps": steps,
                          "identical": sum(a == b for a, b in zip(out, refs[k])), "of": len(out)}
        print(json.dumps(row), flush=True)
        results.append(row)
    Path(args.out).write_text(json.dumps({**provenance(), "tree": "s5 k4 n12, float32, no context candidates",
                                          "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
