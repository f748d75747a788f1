"""Rank 0's continuous-batching scheduler over a paged KV pool.

A sequence is its tokens plus how many have KV in the cache. Each step feeds every running sequence its uncached
tokens (one for a decode, a chunk for a prefill) within a token budget, so prefill, chunked prefill, decode and
recompute-after-preemption are one code path. Followers only execute the plans rank 0 broadcasts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from worker.prefix_cache import Node, PrefixCache
from worker.sampling.grammar import Matcher
from worker.sampling.params import SamplingParams, TokenLogprobs
from worker.stats import EngineSnapshot, PrefixCacheCounts, SpecCounts


class BlockPool:
    """Free list of KV blocks; a block holds `block_size` consecutive token slots of one sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free)
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
        blocks.clear()


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    generator: torch.Generator
    arrival: float = field(default_factory=time.monotonic)
    num_cached: int = 0
    draft_cached: int = 0  # speculative decoding: positions whose draft-head KV is valid
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_scheduled: float | None = None
    reported: bool = False
    # tokens produced but not yet reported to the front end
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    grammar: Matcher | None = None  # rank 0's grammar state for a constrained request
    cache_nodes: list[Node] = field(default_factory=list)  # prefix-cache blocks this sequence pins: block_table[:n]
    num_hit_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    spec: SpecCounts | None = None  # speculation figures of this request alone (speculative/leader.py)
    sync_seconds: float = 0.0  # time the steps it took part in waited on rank 0's decision broadcasts

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step, starting at seq.num_cached

    @property
    def samples(self) -> bool:
        """A token is sampled when this chunk reaches the end of the sequence's tokens."""
        return self.seq.num_cached + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(
        self, pool: BlockPool, max_running: int, token_budget: int, max_model_len: int, cache: PrefixCache | None = None
    ):
        self.pool, self.cache = pool, cache
        self.max_running, self.token_budget, self.max_model_len = max_running, token_budget, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_request: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.by_request[seq.request_id] = seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, total_tokens: int) -> bool:
        need = self.pool.blocks_for(total_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free and self.cache is not None:
            self.pool.release(self.cache.evict(need - self.pool.num_free))
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Drop a sequence's KV and requeue it at the front; it is recomputed from its tokens later."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached = seq.draft_cached = 0
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self, reserve: int = 0) -> list[ScheduledSeq]:
        """Pick this step's work. `reserve` extra slots per decoding sequence (EAGLE's draft tree)."""
        budget = self.token_budget
        batch: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue
            n = min(seq.num_uncached, budget)
            extra = reserve if n == seq.num_uncached else 0
            while not self._grow(seq, seq.num_cached + n + extra):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                batch.append(ScheduledSeq(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            self._lookup(seq)
            n = min(seq.num_uncached, budget)
            extra = reserve if n == seq.num_uncached else 0
            if not self._grow(seq, seq.num_cached + n + extra):
                self._release(seq)
                seq.num_cached = seq.draft_cached = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
                seq.num_hit_tokens = seq.num_cached
                if self.cache is not None:
                    self.cache.stats.prompt_tokens += seq.num_prompt
                    self.cache.stats.hit_tokens += seq.num_cached
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def check_finished(self, seq: Sequence, eos_ids: tuple[int, ...]) -> bool:
        """Called after each appended token; sets finish_reason when the sequence is done."""
        last = seq.token_ids[-1]
        p = seq.params
        if (not p.ignore_eos and last in eos_ids) or last in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.grammar is not None and seq.grammar.terminated:
            seq.finish_reason = "stop"  # the grammar is complete (JSON closed) even where EOS is ignored
        elif len(seq.output_ids) >= p.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Remove a sequence from every queue and return its KV blocks."""
        if reason is not None:
            seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self.by_request.pop(seq.request_id, None)

    # --- prefix cache --------------------------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> None:
        """At admission: share the cached blocks that prefix the sequence's tokens (PrefixCache.match)."""
        if self.cache is None or seq.num_cached or seq.block_table:
            return
        chain = self.cache.match(seq.token_ids)
        if not chain:
            return
        self.cache.pin(chain)
        bs = self.pool.block_size
        seq.cache_nodes = chain
        seq.block_table = [n.block for n in chain]
        seq.num_cached = len(chain) * bs
        seq.draft_cached = next((i for i, n in enumerate(chain) if not n.draft_ok), len(chain)) * bs

    def cache_progress(self, seq: Sequence) -> None:
        """After a prefill chunk: its full blocks join the tree, so requests arriving meanwhile share them."""
        if self.cache is not None:
            self._insert(seq)

    def _insert(self, seq: Sequence) -> None:
        dups = self.cache.insert(seq.token_ids, seq.block_table, seq.cache_nodes, seq.num_cached, seq.draft_cached)
        for i, node in dups:  # the same tokens cached by another sequence: share its block, free ours
            self.pool.release([seq.block_table[i]])
            seq.block_table[i] = node.block
            if not node.draft_ok:  # the shared block's draft KV may be missing: the draft catches up from here
                seq.draft_cached = min(seq.draft_cached, i * self.pool.block_size)

    def _release(self, seq: Sequence) -> None:
        """Hand the sequence's full blocks to the tree, free the rest, unpin what it used."""
        if self.cache is None:
            self.pool.release(seq.block_table)
            return
        self.cache.mark_draft(seq.cache_nodes, seq.draft_cached)
        self._insert(seq)
        self.pool.release(seq.block_table[len(seq.cache_nodes) :])
        self.cache.unpin(seq.cache_nodes)
        seq.block_table.clear()
        seq.cache_nodes = []

    def snapshot(self, **more) -> EngineSnapshot:
        bs = self.pool.block_size
        idle = 0 if self.cache is None else self.cache.evictable()  # cached, held by no one: free on demand
        c = self.cache.stats if self.cache is not None else None
        return EngineSnapshot(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_used_tokens=(self.pool.num_blocks - self.pool.num_free - idle) * bs,
            kv_total_tokens=self.pool.num_blocks * bs,
            num_preemptions=self.num_preemptions,
            prefix_cache=None
            if c is None
            else PrefixCacheCounts(c.prompt_tokens, c.hit_tokens, c.cached_blocks * bs, c.evicted_blocks * bs),
            **more,
        )
