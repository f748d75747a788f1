"""Rank 0's prefix cache without a model: the radix tree of KV blocks and the scheduler's bookkeeping."""

from __future__ import annotations

import torch

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
    private = [b for s in sched.running for b in s.block_table[len(s.cache_nodes) :]]
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
