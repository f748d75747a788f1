"""Rank 0's prefix cache: the radix tree and the scheduler's bookkeeping (no model), then real engines: outputs
identical with and without the cache over multi-turn chats at tp=1 and tp=3 with speculation on and off, hits
seen in stats and usage, eviction under a small pool, aborts during a hit."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.engine import Engine
from speculative.defaults import DEFAULT_HEAD
from worker.config import EngineConfig, SpecConfig
from worker.prefix_cache import PrefixCache
from worker.sampling.params import SamplingParams
from worker.scheduler import BlockPool, Scheduler, Sequence

BS = 4


def _seq(i: int, tokens: list[int], max_new: int = 4) -> Sequence:
    return Sequence(i, f"r{i}", list(tokens), len(tokens), SamplingParams(max_new_tokens=max_new), torch.Generator())


def _run_prefill(sched: Scheduler) -> list[Sequence]:
    """One scheduling step whose forwards all succeed: every scheduled chunk becomes cached."""
    batch = sched.schedule()
    for item in batch:
        item.seq.num_cached += item.num_tokens
        if item.num_tokens > 1:
            sched.cache_progress(item.seq)
    return [item.seq for item in batch]


def _check(sched: Scheduler) -> None:
    """No block is both free and held; every held block belongs to one sequence or one tree node."""
    pool, cache = sched.pool, sched.cache
    free = list(pool.free)
    assert len(free) == len(set(free))
    tree = cache.blocks()
    private = [b for s in sched.running for b in s.block_table[len(s.cache_nodes):]]
    assert len(private) == len(set(private)) and not set(private) & tree and not set(free) & (tree | set(private))
    for s in sched.running:
        assert [n.block for n in s.cache_nodes] == s.block_table[: len(s.cache_nodes)]
        assert all(n.refs > 0 for n in s.cache_nodes)
    assert len(free) + len(tree) + len(private) == pool.num_blocks


def test_second_sequence_shares_the_first_ones_prefix_blocks():
    sched = Scheduler(BlockPool(16, BS), 8, 64, 64, PrefixCache(BS))
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks
    a = _seq(0, prompt)
    sched.add(a)
    _run_prefill(sched)
    assert len(a.cache_nodes) == 3  # inserted after its prefill
    b = _seq(1, prompt[:13] + [7, 8, 9])
    sched.add(b)
    _run_prefill(sched)
    assert b.num_hit_tokens == 8  # 3 blocks matched, 2 shared at admission, the third recomputed ...
    assert b.block_table[:3] == a.block_table[:3]  # ... then deduplicated into the cached copy
    assert [n.refs for n in a.cache_nodes] == [2, 2, 2]
    _check(sched)
    sched.finish(a)
    _check(sched)
    sched.finish(b)
    assert sched.cache.pinned == 0 and sched.cache.evictable() == sched.cache.stats.cached_blocks
    assert sched.pool.num_free + sched.cache.stats.cached_blocks == 16


def test_eviction_under_a_small_pool_never_frees_a_held_block():
    sched = Scheduler(BlockPool(10, BS), 4, 64, 64, PrefixCache(BS))
    seqs = [_seq(i, [i] * 3 + list(range(200, 210)) + [i] * 6) for i in range(12)]  # 19 tokens: 5 blocks each
    done = 0
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        running = _run_prefill(sched)
        _check(sched)
        for s in running:
            if s.num_cached == len(s.token_ids):
                sched.finish(s)
                done += 1
        if not sched.has_work():
            break
    assert done == 12 and sched.cache.stats.evicted_blocks > 0
    assert sched.cache.pinned == 0
    assert sched.pool.num_free + sched.cache.stats.cached_blocks == 10


def test_abort_during_a_hit_prefill_leaves_references_consistent():
    sched = Scheduler(BlockPool(32, BS), 8, 6, 256, PrefixCache(BS))  # 6-token chunks: the prefill takes steps
    prompt = list(range(300, 340))
    a = _seq(0, prompt)
    sched.add(a)
    while a.num_cached < len(prompt):
        _run_prefill(sched)
    sched.finish(a)
    b = _seq(1, prompt + list(range(400, 430)))
    sched.add(b)
    _run_prefill(sched)  # hit, then one chunk of the rest
    assert b.num_hit_tokens == 36 and b.num_cached < len(b.token_ids)  # 10 blocks matched, the last recomputed
    _check(sched)
    sched.finish(b, "abort")
    assert sched.cache.pinned == 0 and all(n.refs == 0 for n in sched.cache._nodes())
    assert sched.pool.num_free + sched.cache.stats.cached_blocks == 32


# --- real engines ---------------------------------------------------------------------------------------------
SYSTEM = ("You are a careful assistant for a travel company. Answer in one or two short sentences, name concrete "
          "places, and never invent prices. If a question is unclear, ask one clarifying question.")
CONVERSATIONS = [["Where should I go in Italy in spring?", "What about food there?", "And how do I get around?"],
                 ["Suggest a weekend trip from Paris.", "Is it good for children?", "What should I pack?"]]
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


def test_two_sequences_prefilling_the_same_prompt_at_once_end_up_sharing_blocks():
    sched = Scheduler(BlockPool(16, BS), 8, 64, 64, PrefixCache(BS))
    prompt = list(range(500, 513))
    a, b = _seq(0, prompt), _seq(1, prompt)
    sched.add(a)
    sched.add(b)
    _run_prefill(sched)  # both admitted in one step: neither could hit, each computed its own blocks
    assert a.num_hit_tokens == b.num_hit_tokens == 0
    assert b.block_table[:3] == a.block_table[:3] and [n.refs for n in a.cache_nodes] == [2, 2, 2]
    _check(sched)
    assert sched.pool.num_free == 16 - 3 - 2  # three shared blocks, one private tail each
