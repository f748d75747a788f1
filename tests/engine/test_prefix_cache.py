"""Rank 0's prefix cache in real engines: outputs identical with and without the cache over multi-turn chats at
tp=1 and tp=3 with speculation on and off, hits seen in stats and usage, eviction under a small pool."""

from __future__ import annotations

import time

import pytest

from runtime.engine import Engine
from speculative.defaults import DEFAULT_HEAD
from worker.config import EngineConfig, SpecConfig
from worker.sampling.params import SamplingParams

SYSTEM = (
    "You are a careful assistant for a travel company. Answer in one or two short sentences, name concrete "
    "places, and never invent prices. If a question is unclear, ask one clarifying question."
)


CONVERSATIONS = [
    ["Where should I go in Italy in spring?", "What about food there?", "And how do I get around?"],
    ["Suggest a weekend trip from Paris.", "Is it good for children?", "What should I pack?"],
]


TURN = SamplingParams(max_new_tokens=12, temperature=0)


def _chat_ids(engine: Engine, history: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    return engine.encode(text)


def _converse(engine: Engine) -> tuple[list[list[int]], list[int]]:
    """Every conversation advances one turn per batch, its whole history resent; returns answers and hits."""
    histories = [[{"role": "system", "content": SYSTEM}] for _ in CONVERSATIONS]
    answers, hits = [], []
    for turn in range(3):
        for h, conv in zip(histories, CONVERSATIONS):
            h.append({"role": "user", "content": conv[turn]})
        before = engine.stats.values.get("prefix_cache_hit_tokens", 0)
        out = engine.generate([_chat_ids(engine, h) for h in histories], TURN)
        hits.append(engine.stats.values.get("prefix_cache_hit_tokens", 0) - before)
        for h, r in zip(histories, out):
            h.append({"role": "assistant", "content": r.text})
            answers.append(r.token_ids)
    return answers, hits


@pytest.fixture(scope="module")
def uncached(smol_dir):
    with Engine(EngineConfig(dtype="float32", max_total_tokens=8192, disable_radix_cache=True)) as eng:
        answers, hits = _converse(eng)
        assert "prefix_cache_hit_tokens" not in eng.stats.values
    return answers


def _spec() -> SpecConfig:
    return SpecConfig("EAGLE3", str(DEFAULT_HEAD), num_steps=3, eagle_topk=2, num_draft_tokens=6, cost_table="off")


def test_cached_multi_turn_output_is_identical_at_tp1(smol_engine, uncached):
    answers, hits = _converse(smol_engine)
    assert answers == uncached
    assert hits[1] > 0 and hits[2] > hits[1]  # later turns resend longer histories


@pytest.mark.parametrize("tp,spec", [(1, True), (3, True)], ids=["tp1-eagle", "tp3-eagle"])
def test_cached_multi_turn_output_is_identical(smol_dir, uncached, tp, spec):
    cfg = EngineConfig(dtype="float32", max_total_tokens=8192, tp_size=tp, spec=_spec() if spec else SpecConfig())
    with Engine(cfg) as eng:
        answers, hits = _converse(eng)
        stats = eng.stats.values
    assert answers == uncached
    assert hits[1] > 0 and stats["rank_divergences"] == 0 and stats["kv_used_tokens"] == 0
    if spec:
        assert stats["spec_accepted_tokens"] > 0


def test_a_repeated_long_prefix_prefills_only_its_new_tokens(smol_engine):
    long_prefix = " ".join(f"item{i}" for i in range(400))
    first = smol_engine.encode(long_prefix + " Question one?")
    second = smol_engine.encode(long_prefix + " Question two, longer?")
    one = SamplingParams(max_new_tokens=1, temperature=0)
    before = smol_engine.stats.values.get("prefix_cache_hit_tokens", 0)
    t0 = time.perf_counter()
    smol_engine.generate([first], one)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    smol_engine.generate([second], one)
    warm = time.perf_counter() - t0
    hit = smol_engine.stats.values["prefix_cache_hit_tokens"] - before
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert shared - 32 < hit <= shared - 16  # every full block of the common prefix but the last, nothing else
    assert warm < cold / 2, (warm, cold)  # ~800 tokens prefilled versus a handful


def test_small_pool_evicts_and_keeps_serving(smol_dir):
    cfg = EngineConfig(dtype="float32", max_total_tokens=256, block_size=16)
    prompts = [f"Tell me about the number {i}. " * 6 for i in range(8)]
    with Engine(cfg) as eng:
        out = eng.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))
        again = eng.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=0))
        stats = eng.stats.values
    assert all(r.finish_reason in ("stop", "length") for r in out)
    assert [r.token_ids for r in again] == [r.token_ids for r in out[:2]]
    assert stats["prefix_cache_evicted_tokens"] > 0 and stats["kv_used_tokens"] == 0
