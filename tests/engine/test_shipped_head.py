"""The EAGLE head shipped for the default model: it loads, it is served by default, it accepts well, it is lossless."""

from __future__ import annotations

import dataclasses

from devtools.prompts import QUESTIONS, chat, fixed_tree
from devtools.prompts import serve_args as _cli
from runtime.engine import Engine
from speculative.defaults import DEFAULT_HEAD, resolve_spec_config
from worker.config import EngineConfig
from worker.sampling.params import SamplingParams


def test_default_model_serves_with_the_shipped_head_by_default():
    spec = resolve_spec_config(_cli())
    assert spec.algorithm == "EAGLE3" and spec.draft_model_path == str(DEFAULT_HEAD)
    assert spec.disable_batch_size == 9  # large decode batches decode plainly unless told otherwise
    assert spec.calibrate_batch_limit  # rank 0 lowers the limit where its start-up timing finds rows dearer
    explicit = resolve_spec_config(_cli("--speculative-disable-batch-size", "0"))
    assert explicit.disable_batch_size == 0 and not explicit.calibrate_batch_limit  # as given
    assert (DEFAULT_HEAD / "model.safetensors").exists() and (DEFAULT_HEAD / "README.md").exists()
    assert resolve_spec_config(_cli("--speculative-algorithm", "NONE")).algorithm == "NONE"
    assert resolve_spec_config(_cli("--model-path", "/some/other/model")).algorithm == "NONE"


def test_shipped_head_accepts_more_than_one_and_three_quarter_tokens_per_step(smol_engine):
    prompts = [smol_engine.encode(chat(smol_engine, q)) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=64, temperature=0)
    ref = [r.token_ids for r in smol_engine.generate(prompts, params)]
    # a random head accepts ~1.0 on this tree; the served default drafts one token and lets rank 0 size each step
    spec = fixed_tree(str(DEFAULT_HEAD))
    assert spec.draft_model_path == str(DEFAULT_HEAD)
    # one batch: the fixed tree drafts for every sequence at every step, so each one's accepted tokens are what it
    # accepts alone, and a float32 step of 8 rows costs what one of 1 does (its weights are read once)
    spec = dataclasses.replace(spec, disable_batch_size=0, calibrate_batch_limit=False)
    with Engine(EngineConfig(dtype="float32", max_total_tokens=8192, spec=spec)) as eng:
        out = [r.token_ids for r in eng.generate(prompts, params)]
        stats = eng.stats.values
    assert out == ref
    print(f"shipped head: accept length {stats['spec_accept_length_mean']:.2f} tokens per verify step")
    # the shipped head measures 1.86 here (float32 is deterministic; 1.946 on bench/head_accept.py's 8 x 128 set)
    assert stats["spec_accept_length_mean"] > 1.8


def test_large_decode_batches_skip_speculation_when_asked(served_engine):
    """--speculative-disable-batch-size: a batch at the limit decodes plainly (same output), a lone request drafts.
    On the served numerics, as `eaglegate serve` runs the default model."""
    prompts = [served_engine.encode(chat(served_engine, q)) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)  # the batch stays whole
    ref = [r.token_ids for r in served_engine.generate(prompts, params)]
    spec = resolve_spec_config(_cli("--speculative-disable-batch-size", "2"))
    assert spec.disable_batch_size == 2
    with Engine(EngineConfig(max_total_tokens=8192, spec=spec)) as eng:
        out = [r.token_ids for r in eng.generate(prompts, params)]
        batched_steps = eng.stats.values["spec_verify_steps"]
        alone = eng.generate([prompts[0]], params)[0].token_ids
        alone_steps = eng.stats.values["spec_verify_steps"]
        grid = eng.stats.values["spec_verify_cost_ms"]
        assert eng.stats.values["spec_disable_batch_size"] == 2  # as given: not lowered, nor raised
    assert out == ref and alone == ref[0]
    assert batched_steps == 0
    assert alone_steps > 0
    # rank 0 timed verify forwards at start-up by context, batch size and rows per sequence, up to the widest tree
    # (2 EAGLE + 8 context rows), for the batches that can speculate: below the limit of 2, one sequence
    assert list(grid) == ["context 64", "context 512"]
    assert all(list(plane) == ["batch 1"] for plane in grid.values())
    rows = [row for plane in grid.values() for row in plane.values()]
    assert all(list(row) == ["1", "2", "3", "5", "10"] and min(row.values()) > 0 for row in rows)
