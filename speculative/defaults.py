"""Speculative settings from CLI flags, with the shipped head as the default model's default."""

from __future__ import annotations

from worker.config import SpecConfig


def resolve_spec_config(args) -> SpecConfig:
    algo = (args.speculative_algorithm or "NONE").upper()
    if algo == "NONE":
        return SpecConfig()
    steps = args.speculative_num_steps or 4
    topk = args.speculative_eagle_topk or 1
    draft = args.speculative_num_draft_tokens or (steps + 1 if topk == 1 else min(steps * topk + 1, 16))
    return SpecConfig(algorithm=algo, draft_model_path=args.speculative_draft_model_path, num_steps=steps,
                      eagle_topk=topk, num_draft_tokens=draft,
                      accept_threshold_single=args.speculative_accept_threshold_single,
                      accept_threshold_acc=args.speculative_accept_threshold_acc)
