"""The rank protocol: every rank runs the same collectives in the same order, and the guard sees what they applied."""

from __future__ import annotations

import json
import queue

import pytest

from devtools.models import save_copy_eagle_head, save_tiny_model
from runtime.engine import Engine, EngineDeadError, _Sink
from worker.config import EngineConfig, SpecConfig
from worker.model.config import load_model_config
from worker.model.files import resolve_model
from worker.sampling.params import SamplingParams


def _with_head(model, root):
    return model, save_copy_eagle_head(root / "head", load_model_config(resolve_model(str(model))))


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """tp -> (model, copy head): 8 heads split over 2 ranks, 6 heads (3 KV heads) over 3."""
    tiny6 = save_tiny_model(
        tmp_path_factory.mktemp("tiny6") / "m", "llama", heads=6, kv_heads=3, hidden=96, intermediate=192
    )
    return {
        2: _with_head(tiny_llama, tmp_path_factory.mktemp("t2")),
        3: _with_head(tiny6, tmp_path_factory.mktemp("t3")),
    }


def _spec(head) -> SpecConfig:  # the served budget (auto) and context drafts, a small tree
    return SpecConfig("EAGLE", str(head), num_steps=3, eagle_topk=2, num_draft_tokens=5)


@pytest.mark.parametrize("tp", [2, 3])
def test_every_rank_runs_the_same_collective_sequence(models, tmp_path, tp):
    """Speculation (drafted, context-only and plain steps), sampling, an abort, preemption under a small KV pool
    and the guard on every step: the (collective, shape, dtype) trace of each rank is the same list."""
    model, head = models[tp]
    trace = tmp_path / f"trace-tp{tp}"
    trace.mkdir()
    cfg = EngineConfig(
        model_path=str(model),
        dtype="float32",
        tp_size=tp,
        max_total_tokens=320,
        chunked_prefill_size=32,
        spec=_spec(head),
        debug_collective_trace=str(trace),
    )
    prompts = [[5, 6, 7, 8] * 3, [100, 200, 300], [9] * 10, list(range(40, 70)), [11, 12, 11, 12, 11], [3, 4, 5]]
    params = [
        SamplingParams(max_new_tokens=40, temperature=0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    with Engine(cfg) as eng:
        q: queue.SimpleQueue = queue.SimpleQueue()
        eng.submit([("doomed", [7] * 20, SamplingParams(max_new_tokens=500, ignore_eos=True))], [_Sink(q.put)])
        q.get(timeout=60)  # it is running; drop it mid-flight
        eng.abort("doomed")
        out = eng.generate(prompts, params, timeout=300)
        stats = eng.stats.values
    assert all(len(r.token_ids) == 40 for r in out)
    assert stats["num_preemptions"] > 0 and stats["spec_verify_steps"] > 0 and stats["rank_divergences"] == 0
    traces = [json.loads((trace / f"rank{r}.json").read_text()) for r in range(tp)]
    assert len(traces[0]) > 100
    names = {t[0] for t in traces[0]}
    assert {"broadcast", "broadcast_object", "all_reduce", "all_gather_int64"} <= names
    for r in range(1, tp):
        assert traces[r] == traces[0], f"rank {r} ran a different collective sequence"


def test_a_corrupted_follower_decision_is_caught_at_that_step(models):
    tiny_llama, head = models[2]
    cfg = EngineConfig(
        model_path=str(tiny_llama),
        dtype="float32",
        tp_size=2,
        max_total_tokens=2048,
        spec=SpecConfig("EAGLE", str(head), num_steps=3, eagle_topk=2, num_draft_tokens=5, cost_table="off"),
        debug_corrupt_decision=6,
        dist_timeout=30,
    )
    eng = Engine(cfg)
    try:
        with pytest.raises(EngineDeadError, match=r"RankDivergenceError: TP ranks diverged at step 6\b"):
            eng.generate(
                [[5, 6, 7, 8] * 3], SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True), timeout=60
            )
    finally:
        eng.shutdown()
