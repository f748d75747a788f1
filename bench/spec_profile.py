"""Per-step profile of speculative decoding: accept length, tokens/s and where a step's time goes (draft, verify,
decide), for one draft head on a few MT-bench first turns and several trees, against plain decode in one run.

    .venv/bin/python bench/spec_profile.py [--draft HEAD] [--questions 5] [--max-tokens 96] 4,2,6 5,4,12 4,1,5

Batch 1, bfloat16, MT-bench questions 2 onwards; each tree's engine runs the served defaults (context drafts, the
cost-aware budget) with that tree. It prints one line per tree and writes no results file: use it to choose a tree
for a head or a machine, then bench/spec.py for the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from spec import chat_prompt, mtbench_first_turns, parse_setting, spec_config

from runtime.engine import Engine
from speculative.defaults import DEFAULT_HEAD
from worker.config import EngineConfig
from worker.protocol import StepReport
from worker.sampling.params import SamplingParams


def timed_tokens(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, after_warmup=lambda: None
) -> tuple[int, float]:
    engine.generate([prompts[0]], params)  # warm-up
    after_warmup()
    t0 = time.perf_counter()
    n = sum(len(engine.generate([p], params)[0].token_ids) for p in prompts)
    return n, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("settings", nargs="+", help="trees as steps,topk,num_draft_tokens")
    ap.add_argument("--draft", default=str(DEFAULT_HEAD))
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    questions = mtbench_first_turns(args.questions + 1)[1:]
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0)
    with Engine(EngineConfig(dtype="bfloat16", max_total_tokens=8192)) as plain:
        prompts = [chat_prompt(plain.tokenizer, q) for q in questions]
        n, dt = timed_tokens(plain, prompts, params)
    plain_tps = n / dt
    print(f"plain: {plain_tps:.1f} tok/s, {1000 * dt / n:.2f} ms/token")
    for setting in args.settings:
        steps, topk, ndt = parse_setting(setting)
        rec: dict[str, list[float]] = {}

        def on_step(report: StepReport, rec=rec) -> None:
            m = report.step_metrics
            rec.setdefault("accept_lengths", []).extend(m.accept_lengths)
            for phase, seconds in m.phase_seconds.items():
                rec.setdefault(phase, []).extend(seconds)

        cfg = spec_config(args.draft, (steps, topk, ndt), 0)
        with Engine(EngineConfig(dtype="bfloat16", max_total_tokens=8192, spec=cfg), on_step=on_step) as eng:
            n, dt = timed_tokens(eng, prompts, params, after_warmup=rec.clear)
        phases = " ".join(f"{k} {1000 * statistics.mean(v):.2f}" for k, v in rec.items() if k != "accept_lengths")
        print(
            f"s{steps}k{topk}n{ndt}: {n / dt:.1f} tok/s ({n / dt / plain_tps:.2f}x) accept length "
            f"{statistics.mean(rec['accept_lengths']):.2f}, step {1000 * dt / len(rec['accept_lengths']):.2f} ms = "
            f"{phases}",
            flush=True,
        )


if __name__ == "__main__":
    main()
