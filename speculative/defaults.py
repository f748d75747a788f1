"""Speculative settings from CLI flags, with the shipped head as the default model's default."""

from __future__ import annotations

from pathlib import Path

from worker.config import DEFAULT_MODEL, SpecConfig

DEFAULT_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct-eagle3"
# the shipped head is EAGLE-3 (see its card). On the default int4 weights a one-token draft (s1 k1 n2) is the fastest
# tree on CPU: a 2-row verify costs about one decode step, while each further row costs verify and drafting time
# that the head's few accepted tokens do not repay (docs/speculation.md; bench/spec_profile.py)
DEFAULT_STEPS, DEFAULT_TOPK, DEFAULT_DRAFT_TOKENS = 1, 1, 2
# decode batches of 9+ decode plainly: with rank 0's budget on at every size, N clients in a closed loop on real
# answers ran 1.22x plain at 4, 1.13x at 8 and 0.92x at 16 on CPUs with AMX (bench/spec_batch.py). Rank 0 lowers it
# where its start-up timing finds verify rows dearer (SECOND_ROW_LIMIT in speculative/worker.py)
DEFAULT_DISABLE_BATCH_SIZE = 9


def default_spec_config() -> SpecConfig:
    return SpecConfig(
        "EAGLE3",
        str(DEFAULT_HEAD),
        num_steps=DEFAULT_STEPS,
        eagle_topk=DEFAULT_TOPK,
        num_draft_tokens=DEFAULT_DRAFT_TOKENS,
        disable_batch_size=DEFAULT_DISABLE_BATCH_SIZE,
        calibrate_batch_limit=True,
    )


def resolve_spec_config(args) -> SpecConfig:
    algo = args.speculative_algorithm
    if algo is None:  # speculation is on by default for the default model, with its shipped head
        shipped = args.model_path == DEFAULT_MODEL and (DEFAULT_HEAD / "model.safetensors").exists()
        if not shipped or args.speculative_draft_model_path:
            algo = "EAGLE" if args.speculative_draft_model_path else "NONE"
        else:
            d = default_spec_config()
            return SpecConfig(
                d.algorithm,
                d.draft_model_path,
                num_steps=args.speculative_num_steps or d.num_steps,
                eagle_topk=args.speculative_eagle_topk or d.eagle_topk,
                num_draft_tokens=args.speculative_num_draft_tokens or d.num_draft_tokens,
                accept_threshold_single=args.speculative_accept_threshold_single,
                accept_threshold_acc=args.speculative_accept_threshold_acc,
                disable_batch_size=d.disable_batch_size
                if args.speculative_disable_batch_size is None
                else args.speculative_disable_batch_size,
                calibrate_batch_limit=args.speculative_disable_batch_size is None,
                **_common_args(args),
            )
    algo = algo.upper()
    if algo == "NONE":
        return SpecConfig()
    steps = args.speculative_num_steps or 4
    topk = args.speculative_eagle_topk or 1
    draft = args.speculative_num_draft_tokens or (steps + 1 if topk == 1 else min(steps * topk + 1, 16))
    path = args.speculative_draft_model_path  # None: the target's own MTP layer drafts (speculative/mtp.py)
    if path is None and args.model_path == DEFAULT_MODEL and algo in ("EAGLE", "EAGLE3"):
        path = str(DEFAULT_HEAD)
    return SpecConfig(
        algorithm=algo,
        draft_model_path=path,
        num_steps=steps,
        eagle_topk=topk,
        num_draft_tokens=draft,
        accept_threshold_single=args.speculative_accept_threshold_single,
        accept_threshold_acc=args.speculative_accept_threshold_acc,
        disable_batch_size=args.speculative_disable_batch_size or 0,
        **_common_args(args),
    )


def _common_args(args) -> dict:
    """The flags the shipped head's defaults and an explicit setting take alike: context drafts, the budget's cost
    table, the draft head's weights, the corpus."""
    return {
        "context_tokens": args.speculative_context_tokens,
        "context_ngram": args.speculative_context_ngram,
        "cost_table": args.speculative_cost_table,
        "draft_quantization": args.speculative_draft_quantization,
        "corpus": args.speculative_corpus,
    }
