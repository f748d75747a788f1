"""Speculative decoding on rank 0 (SpecLeader) and on the other ranks (make_spec_follower).

Rank 0 decides every draft candidate, frontier, selection, accepted path and bonus token, and whether to draft
at all; each decision reaches the other ranks through the plan or the decision channel (decisions.py) before any
rank moves KV or seq_lens.
"""

from __future__ import annotations

import dataclasses
import time

from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.leader import Leader, maybe_check
from worker.protocol import SpecPlan, SpecSeq
from worker.runner import ModelRunner
from worker.scheduler import ScheduledSeq, Sequence
from worker.stats import EngineSnapshot, SpecCounts

from . import budget
from .budget import Calibration, Estimates
from .context import context_draft
from .corpus import MAX_MATCH, load_corpus
from .decisions import Commit, DecisionChannel, LeaderState, SpecDecisions
from .tree import draft_only_accepted
from .worker import SpecResult, SpecWorker

# corpus chains share an acceptance estimate by how many occurrences back their first token (1, 2-4, 5-19, 20+), or,
# where fewer tokens than the index's key matched, by the match's length (keyed as minus it)
SUPPORT_BUCKETS = (1, 2, 5, 20)


def _committed(step: SpecPlan, commits: list[Commit]) -> list[int]:
    out = []
    for q, c in zip(step.seqs, commits):
        out += [q.ctx_len + 1 + len(c.path), c.bonus, *c.path]
    return out


class SpecLeader(Leader):
    def __init__(self, config: EngineConfig, runner: ModelRunner, tp: TPGroup):
        self.worker = SpecWorker(config, runner, tp)
        super().__init__(config, runner, tp)
        self.totals = SpecCounts()
        s = config.spec
        cost = self.worker.cost
        self.estimates = Estimates(
            eagle_prior=float(min(s.num_steps, s.num_draft_tokens - 1)),
            calibration=Calibration(s.num_steps),
            frozen=cost.overhead if cost is not None else None,
        )
        self.channel = DecisionChannel(tp)
        self.corpus = load_corpus(config) if s.context_tokens else None

    def chain(self, tokens: list[int]) -> tuple[list[int], tuple[int, int]]:
        """A sequence's free candidates, and their key for the estimates: the context's prompt-lookup chain, or the
        corpus's where it promises more accepted tokens by the running per-key acceptance (a long context chain
        beats a corpus token that is likelier alone)."""
        spec, est = self.config.spec, self.estimates
        ids, n = context_draft(tokens, spec.context_ngram, spec.context_tokens)
        best = ids, (budget.CONTEXT, n)
        if self.corpus is not None:
            more, support, match = self.corpus.draft(tokens[-MAX_MATCH:], spec.context_tokens)
            short = match < self.corpus.key_len
            key = (budget.CORPUS, -match if short else max(b for b in SUPPORT_BUCKETS if b <= max(support, 1)))
            if more and (
                not ids
                or budget.chain_tokens(len(more), est.context_p(key))
                > budget.chain_tokens(len(ids), est.context_p(best[1]))
            ):
                best = more, key
        return best

    @property
    def reserve(self) -> int:
        return self.worker.reserve

    def step(self) -> None:
        batch = self.scheduler.schedule(self.reserve)
        if not batch:
            return
        limit = self.worker.batch_limit
        if all(self._decoding(item) for item in batch) and not (limit and len(batch) >= limit):
            self.spec_step(batch)
        else:  # prefill chunks (decodes ride along) or a batch too large to gain; the draft catches up next time
            self.plain_step(batch)

    @staticmethod
    def _decoding(item: ScheduledSeq) -> bool:
        s = item.seq
        return item.num_tokens == 1 and item.samples and len(s.token_ids) > s.num_prompt

    def spec_step(self, batch: list[ScheduledSeq]) -> None:
        """A decode step for sequences that all decode: rank 0 first picks its kind (budget.plan_step), then runs
        a plain decode, a verify of context candidates, or an EAGLE draft plus verify."""
        started = time.perf_counter()
        seqs = [item.seq for item in batch]
        spec, est = self.config.spec, self.estimates
        # this step's verify cost by rows, for its batch size and mean context
        grid = self.worker.cost
        cost = None if grid is None else grid.at(len(seqs), sum(s.num_cached for s in seqs) / len(seqs))
        found = [self.chain(s.token_ids) for s in seqs]
        kind = budget.DRAFT
        if cost is not None:
            cands = [budget.context_candidates(b, len(ids), est.context_p(key)) for b, (ids, key) in enumerate(found)]
            kind, counts = budget.plan_step(est, cost, cands, spec.num_draft_tokens - 1)
            found = [(ids[:c], key) for (ids, key), c in zip(found, counts)]
            est.chose(kind, len(seqs))
            if kind == budget.PLAIN:
                self._count_step(kind)
                self.plain_step(batch)
                est.observe_step(kind, len(seqs), time.perf_counter() - started - cost.verify(len(seqs)))
                return
        self._count_step(kind)
        self.step_no += 1
        step = SpecPlan(
            self.step_no,
            [
                SpecSeq(
                    s.num_cached,
                    list(s.block_table),
                    s.draft_cached,
                    s.token_ids[s.draft_cached + 1 : s.num_cached + 1],
                    ids,
                    key[0],
                )
                for s, (ids, key) in zip(seqs, found)
            ],
            kind == budget.DRAFT,
        )
        self.broadcast_plan(step, seqs)
        lead = LeaderState(seqs, self.worker.head, cost, est, [key for _, key in found])
        self.channel.seconds = {}
        result: SpecResult = self.worker.run(step, SpecDecisions(self.channel, self.config, len(seqs), lead))
        self._apply(seqs, step, result, [key for _, key in found])
        m = self.step_metrics
        for kind, seconds in self.channel.seconds.items():
            m.sync_seconds.setdefault(kind, []).extend(seconds)
        waited = sum(sum(seconds) for seconds in self.channel.seconds.values())
        for seq in seqs:  # each sequence of the step waited for every draft and verify decision
            seq.sync_seconds += waited
        for phase, seconds in result.timings.items():
            m.phase_seconds.setdefault(phase, []).append(seconds)
        self.check(step, _committed(step, result.commits) + self.channel.state())
        if cost is not None:  # a drafting step's seconds, less catching up after a stretch of other steps
            rows = sum(vt.size for vt in result.trees)
            est.observe_step(
                kind, len(seqs), time.perf_counter() - started - cost.verify(rows) - result.catch_up_seconds
            )

    def _count_step(self, kind: str) -> None:
        kinds = self.step_metrics.spec_steps
        kinds[kind] = kinds.get(kind, 0) + 1

    def _apply(
        self, seqs: list[Sequence], step: SpecPlan, result: SpecResult, chain_keys: list[tuple[int, int]]
    ) -> None:
        m, t, est = self.step_metrics, self.totals, self.estimates
        if not m.accepted_per_position:
            m.accepted_per_position = [0] * self.worker.max_depth
        per_pos = m.accepted_per_position
        off, eagle_accepted = 0, []
        for seq, q, commit, vt, sel, key in zip(
            seqs, step.seqs, result.commits, result.trees, result.selections, chain_keys
        ):
            tokens = [vt.tokens[node] for node in commit.path] + [commit.bonus]
            rows = None
            if seq.params.logprobs is not None:
                rows = [result.verify_logits[off + node] for node in [0, *commit.path]]
            off += vt.size
            seq.num_cached = q.ctx_len + 1 + len(commit.path)
            if step.draft:
                seq.draft_cached = q.ctx_len
            self.append_tokens(seq, tokens, rows)
            a = len(commit.path)
            by_source = {
                src: sum(1 for node in commit.path if vt.sources[node] & src)
                for src in (budget.EAGLE, budget.CONTEXT, budget.CORPUS)
            }
            counts = SpecCounts(
                verify_steps=1,
                drafted_steps=int(step.draft),
                draft_tokens=vt.size - 1,
                accepted_tokens=a,
                eagle_tokens=sum(1 for x in vt.sources if x & budget.EAGLE),
                eagle_accepted_tokens=by_source[budget.EAGLE],
                context_tokens=sum(1 for x in vt.sources if x & budget.CONTEXT),
                context_accepted_tokens=by_source[budget.CONTEXT],
                corpus_tokens=sum(1 for x in vt.sources if x & budget.CORPUS),
                corpus_accepted_tokens=by_source[budget.CORPUS],
            )
            t.add(counts)
            m.spec.add(counts)
            if seq.spec is None:
                seq.spec = SpecCounts()
            seq.spec.add(counts)
            m.accept_lengths.append(a + 1)
            for i in range(a):
                per_pos[i] += 1
            # per sequence that verified a draft-only token (a dropped one cost no row, and one the chain also
            # proposed would have been verified without drafting): what drafting added
            added = draft_only_accepted(vt, commit.path) if step.draft else None
            if added is not None:
                eagle_accepted.append((bool(q.context_ids), added))
            est.observe_context(key, sel.num_context, by_source[key[0]])
        if step.draft:
            est.observe_draft(len(seqs), result.timings["draft"] - result.catch_up_seconds, eagle_accepted)

    def snapshot(self) -> EngineSnapshot:
        snap = super().snapshot()
        snap.spec = dataclasses.replace(self.totals)
        if self.worker.cost is not None:
            snap.spec_verify_cost_ms = self.worker.cost.as_ms()
            snap.spec_draft_calibration = self.estimates.calibration.summary()
        snap.spec_disable_batch_size = self.worker.batch_limit
        return snap


def make_spec_leader(config: EngineConfig, runner: ModelRunner, tp: TPGroup) -> SpecLeader:
    return SpecLeader(config, runner, tp)


def make_spec_follower(config: EngineConfig, runner: ModelRunner, tp: TPGroup):
    """A non-zero rank's speculative step: the same forwards, rank 0's decisions, the guard."""
    worker = SpecWorker(config, runner, tp)
    channel = DecisionChannel(tp, config.debug_corrupt_decision if tp.rank == tp.size - 1 else 0)

    def step(plan: SpecPlan) -> None:
        channel.step = plan.step
        result = worker.run(plan, SpecDecisions(channel, config, len(plan.seqs), None))
        maybe_check(config, tp, plan, _committed(plan, result.commits) + channel.state())

    return step
