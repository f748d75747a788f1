"""Rank 0's cost-aware tree and the free context and corpus drafts in a real engine: output never changes."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest

from devtools.models import save_copy_eagle_head
from devtools.prompts import chat
from runtime.engine import Engine
from speculative.corpus import load_corpus
from speculative.defaults import default_spec_config
from worker.config import EngineConfig
from worker.model.config import load_model_config
from worker.model.files import resolve_model
from worker.sampling.params import SamplingParams

PASSAGE = (
    "The old lighthouse stood on the rocky cliff for more than a hundred years. Every night its keeper climbed "
    "the narrow stairs to light the lamp, and every morning he wrote the weather in a small blue book."
)
FLAT = {"verify_seconds": {"1": 0.01, "64": 0.01}}  # verifying is free: every candidate pays
STEEP = {"verify_seconds": {"1": 0.01, "2": 1.0}}  # a second row costs 100 steps: nothing pays


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


@pytest.fixture(scope="module")
def copy_head(tmp_path_factory, smol_dir):
    return save_copy_eagle_head(
        tmp_path_factory.mktemp("copy-head"), load_model_config(resolve_model("smollm2-135m-instruct"))
    )


def _table(tmp_path, data: dict) -> str:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_cost_table_decides_whether_to_draft(served_engine, copy_head, tmp_path):
    prompts = [served_engine.encode(p) for p in ["A A A A A A A A", "The capital of France is", "1 2 3 1 2 3 1 2"]]
    params = [SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)] * len(prompts)
    ref = [r.token_ids for r in served_engine.generate(prompts, params)]
    spec = dataclasses.replace(
        default_spec_config(),
        algorithm="EAGLE",
        draft_model_path=str(copy_head),
        num_steps=3,
        eagle_topk=2,
        num_draft_tokens=6,
    )
    stats = {}
    for name, table in (("steep", STEEP), ("flat", FLAT)):
        cfg = EngineConfig(max_total_tokens=4096, spec=dataclasses.replace(spec, cost_table=_table(tmp_path, table)))
        with Engine(cfg) as eng:
            assert [r.token_ids for r in eng.generate(prompts, params)] == ref
            stats[name] = dict(eng.stats.values)
    assert stats["steep"]["spec_verify_steps"] == 0 and stats["steep"]["spec_drafted_steps"] == 0  # plain steps
    assert stats["flat"]["spec_drafted_steps"] >= stats["flat"]["spec_verify_steps"] / 2 > 0
    assert stats["flat"]["spec_accepted_tokens"] > 10
    cal = stats["flat"]["spec_draft_calibration"]  # rank 0 learned what the copy head's confidence is worth
    assert 0 < cal[1]["observed"] <= stats["flat"]["spec_eagle_tokens"] and 0.0 <= cal[1]["accepted"] <= 1.0
    assert stats["steep"]["spec_draft_calibration"] == {}


@pytest.mark.parametrize("tp", [1, 3])
def test_context_drafts_copy_a_passage_several_tokens_a_step(request, tmp_path, tp):
    """At tp=1 on the served numerics; at tp=3 in float32 against float32 at tp=1 (the served kernels round each
    rank's partial sums before they meet, so tp=3 may part from tp=1 at a near-tie: see test_quantization.py)."""
    plain = request.getfixturevalue("served_engine" if tp == 1 else "smol_engine")
    prompt = plain.encode(chat(plain, f"Repeat this passage exactly:\n\n{PASSAGE}"))
    ref = plain.generate([prompt], _greedy(48))[0].token_ids
    spec = dataclasses.replace(default_spec_config(), cost_table=_table(tmp_path, FLAT))
    dtype = "auto" if tp == 1 else "float32"
    with Engine(EngineConfig(dtype=dtype, max_total_tokens=4096, tp_size=tp, spec=spec)) as eng:
        out = eng.generate([prompt], _greedy(48))[0].token_ids
        s = eng.stats.values
    assert out == ref
    per_step = s["spec_accepted_tokens"] / s["spec_verify_steps"]
    print(
        f"tp={tp}: {per_step:.2f} accepted tokens per step, {s['spec_context_accepted_tokens']} from the context, "
        f"{s['spec_eagle_accepted_tokens']} from EAGLE"
    )
    assert per_step >= 3
    assert s["spec_context_accepted_tokens"] > s["spec_eagle_accepted_tokens"]


def test_corpus_drafts_an_answer_the_target_gave_before(smol_engine, tmp_path):
    """A corpus holding the target's own answer (a folder in the distilled format, built once, then read from the
    cache): its chains are verified and accepted, several tokens a step, and the output is plain greedy's."""
    question = chat(smol_engine, "Name three things a lighthouse keeper does every day.")
    prompt = smol_engine.encode(question)
    ref = smol_engine.generate([prompt], _greedy(48))[0].token_ids
    folder = tmp_path / "answers"
    folder.mkdir()
    with gzip.open(folder / "answers-000.jsonl.gz", "wt") as f:
        f.write(json.dumps({"i": 0, "ids": ref}) + "\n")
    spec = dataclasses.replace(default_spec_config(), cost_table=_table(tmp_path, FLAT), corpus=str(folder))
    config = EngineConfig(dtype="float32", max_total_tokens=4096, spec=spec)
    built, cached = load_corpus(config), load_corpus(config)
    assert cached.draft(ref[:8], 4) == built.draft(ref[:8], 4) == (ref[8:12], 1, 8)
    with Engine(config) as eng:
        out = eng.generate([prompt], _greedy(48))[0].token_ids
        s = eng.stats.values
    assert out == ref
    print(
        f"{s['spec_accepted_tokens'] / s['spec_verify_steps']:.2f} accepted tokens per step, "
        f"{s['spec_corpus_accepted_tokens']} from the corpus, {s['spec_eagle_accepted_tokens']} from EAGLE"
    )
    assert s["spec_corpus_accepted_tokens"] >= 30
    assert s["spec_accepted_tokens"] / s["spec_verify_steps"] >= 3
