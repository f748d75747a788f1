"""Speculative decoding on rank 0 (SpecLeader) and on the other ranks (run_spec_follower).

Rank 0 decides every draft candidate, frontier, selection, accepted path and bonus token and broadcasts each
as one packed int64 tensor, before any rank moves KV or seq_lens. With --debug-skip-decision-broadcast (tests
only) the verify decision is instead taken by each rank from its own logits, reproducing the upstream hang
class; the divergence guard then reports it.
"""

from __future__ import annotations

import time

import torch

from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.leader import Leader, maybe_check
from worker.protocol import StepPlan
from worker.runner import ModelRunner
from worker.sampling import apply_penalties, filter_probs
from worker.scheduler import ScheduledSeq, Sequence

from .plan import SpecSeq, SpecStep
from .tree import DraftTree, VerifyTree, select_candidates
from .verify import verify_greedy, verify_sampling
from .worker import Commit, SpecResult, SpecWorker


class _Decisions:
    """Shared shape of the deciders: each decision point is one broadcast of a [B, width] int64 tensor."""

    def __init__(self, tp: TPGroup, config: EngineConfig, batch: int):
        self.tp, self.config, self.batch = tp, config, batch
        self.scores: list[list[float]] | None = None
        self.sync_seconds: dict[str, list[float]] = {"draft": [], "verify": []}

    def _sync(self, payload: torch.Tensor | None, width: int, kind: str) -> torch.Tensor:
        t = payload if payload is not None else torch.empty(self.batch, width, dtype=torch.int64)
        if self.tp.size > 1:
            t0 = time.perf_counter()
            self.tp.broadcast_tensor(t)
            self.sync_seconds[kind].append(time.perf_counter() - t0)
        return t

    @staticmethod
    def pack_commits(commits: list[Commit], width: int) -> torch.Tensor:
        out = torch.full((len(commits), width), -1, dtype=torch.int64)
        for b, c in enumerate(commits):
            out[b, 0], out[b, 1] = len(c.path), c.bonus
            out[b, 2 : 2 + len(c.path)] = torch.tensor(c.path, dtype=torch.int64)
        return out

    @staticmethod
    def unpack_commits(t: torch.Tensor) -> list[Commit]:
        rows = t.tolist()
        return [Commit(row[2 : 2 + row[0]], row[1]) for row in rows]

    def local_greedy(self, vtrees: list[VerifyTree], logits: torch.Tensor) -> list[Commit]:
        """A rank's own decision from its own logits: what ranks do without the broadcast (the bug)."""
        commits, off = [], 0
        for vt in vtrees:
            rows = logits[off : off + vt.size]
            path, bonus = verify_greedy(vt, lambda node, _toks, rows=rows: int(torch.argmax(rows[node])))
            commits.append(Commit(path, bonus))
            off += vt.size
        return commits

    def accept(self, vtrees: list[VerifyTree], logits: torch.Tensor) -> list[Commit]:
        width = 2 + self.config.spec.num_steps
        if self.config.debug_skip_decision_broadcast:
            return self.decide_accept(vtrees, logits)
        mine = self.decide_accept(vtrees, logits) if self.tp.is_leader else None
        packed = self._sync(self.pack_commits(mine, width) if mine is not None else None, width, "verify")
        return mine if mine is not None else self.unpack_commits(packed)

    def decide_accept(self, vtrees, logits) -> list[Commit]:
        return self.local_greedy(vtrees, logits)


class LeaderDecider(_Decisions):
    def __init__(self, tp: TPGroup, config: EngineConfig, seqs: list[Sequence], head):
        super().__init__(tp, config, len(seqs))
        self.seqs = seqs
        self.head = head  # maps draft-vocabulary ids to target ids (FR-Spec subset, EAGLE-3 d2t)
        self._child_scores: list[list[float]] = []

    def first(self, logp: torch.Tensor, k: int) -> torch.Tensor:
        vals, idx = torch.topk(logp, k, dim=-1)
        self.scores = vals.tolist()
        return self._sync(self._head_ids(idx), k, "draft")

    def _head_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(idx).cpu()

    def expand(self, logp: torch.Tensor, trees: list[DraftTree], k: int, last: bool):
        vals, idx = torch.topk(logp, k, dim=-1)  # [B, k(frontier), k(children)]
        B = logp.shape[0]
        parent_scores = torch.tensor([[t.scores[c] for c in t.frontier] for t in trees])
        cum = (parent_scores.unsqueeze(-1) + vals.cpu()).view(B, k * k)
        self._child_scores = cum.tolist()
        children = self._head_ids(idx).view(B, k * k)
        if last:
            return self._sync(children, k * k, "draft"), None
        picks = torch.topk(cum, k, dim=-1).indices
        packed = self._sync(torch.cat([children, picks], dim=1), k * k + k, "draft")
        return packed[:, : k * k], packed[:, k * k :]

    def child_score(self, b: int, j: int, m: int) -> float:
        return self._child_scores[b][j * self.config.spec.eagle_topk + m]

    def select(self, trees: list[DraftTree], num: int) -> list[list[int]]:
        if all(len(t.tokens) == num for t in trees):
            return [list(range(num)) for _ in trees]  # forced: nothing to decide (chains)
        chosen = torch.tensor([select_candidates(t, num) for t in trees], dtype=torch.int64)
        return self._sync(chosen, num, "draft").tolist()

    def decide_accept(self, vtrees: list[VerifyTree], logits: torch.Tensor) -> list[Commit]:
        spec = self.config.spec
        commits, off = [], 0
        for seq, vt in zip(self.seqs, vtrees):
            rows = logits[off : off + vt.size]
            off += vt.size
            p = seq.params

            def processed(node: int, path_tokens: list[int], rows=rows, seq=seq) -> torch.Tensor:
                row = rows[node]
                if seq.params.has_penalties:
                    row = row.clone()
                    apply_penalties(row, seq.params, seq.token_ids[: seq.num_prompt], seq.output_ids + path_tokens)
                return row

            if p.greedy:
                path, bonus = verify_greedy(vt, lambda node, toks, f=processed: int(torch.argmax(f(node, toks))))
            else:
                path, bonus = verify_sampling(vt, lambda node, toks, f=processed, p=p: filter_probs(f(node, toks), p),
                                              seq.generator, spec.accept_threshold_single, spec.accept_threshold_acc)
            commits.append(Commit(path, bonus))
        return commits


class FollowerDecider(_Decisions):
    def first(self, logp: torch.Tensor, k: int) -> torch.Tensor:
        return self._sync(None, k, "draft")

    def expand(self, logp, trees, k: int, last: bool):
        if last:
            return self._sync(None, k * k, "draft"), None
        packed = self._sync(None, k * k + k, "draft")
        return packed[:, : k * k], packed[:, k * k :]

    def select(self, trees: list[DraftTree], num: int) -> list[list[int]]:
        if all(len(t.tokens) == num for t in trees):
            return [list(range(num)) for _ in trees]
        return self._sync(None, num, "draft").tolist()


def _committed(step: SpecStep, commits: list[Commit]) -> list[int]:
    out = []
    for q, c in zip(step.seqs, commits):
        out += [q.ctx_len + 1 + len(c.path), c.bonus, *c.path]
    return out


class SpecLeader(Leader):
    def __init__(self, config: EngineConfig, runner: ModelRunner, tp: TPGroup):
        self.worker = SpecWorker(config, runner, tp)
        super().__init__(config, runner, tp)
        self.totals = {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}

    @property
    def reserve(self) -> int:
        return self.worker.reserve

    def step(self) -> None:
        batch = self.scheduler.schedule(self.reserve)
        if not batch:
            return
        limit = self.config.spec.disable_batch_size
        if all(self._decoding(item) for item in batch) and not (limit and len(batch) >= limit):
            self.spec_step([item.seq for item in batch])
        else:  # prefill chunks (decodes ride along) or a batch too large to gain; the draft catches up next time
            self.plain_step(batch)

    @staticmethod
    def _decoding(item: ScheduledSeq) -> bool:
        s = item.seq
        return item.num_tokens == 1 and item.samples and len(s.token_ids) > s.num_prompt

    def spec_step(self, seqs: list[Sequence]) -> None:
        self.step_no += 1
        step = SpecStep([SpecSeq(s.num_cached, list(s.block_table), s.draft_cached,
                                 s.token_ids[s.draft_cached + 1 : s.num_cached + 1]) for s in seqs])
        plan = StepPlan(self.step_no, "spec", spec=step)
        self.broadcast_plan(plan)
        decider = LeaderDecider(self.tp, self.config, seqs, self.worker.head)
        result: SpecResult = self.worker.run(step, decider)
        self._apply(seqs, step, result)
        m = self.step_metrics
        m.setdefault("verify_sync", []).extend(decider.sync_seconds["verify"])
        m.setdefault("draft_sync", []).extend(decider.sync_seconds["draft"])
        for key, value in result.timings.items():
            m.setdefault(f"spec_{key}_seconds", []).append(value)
        self.check(plan, _committed(step, result.commits))

    def _apply(self, seqs: list[Sequence], step: SpecStep, result: SpecResult) -> None:
        m = self.step_metrics
        per_pos = m.setdefault("accepted_per_position", [0] * self.config.spec.num_steps)
        off = 0
        for seq, q, commit, vt in zip(seqs, step.seqs, result.commits, result.trees):
            tokens = [vt.tokens[node] for node in commit.path] + [commit.bonus]
            rows = None
            if seq.params.logprobs is not None:
                rows = [result.verify_logits[off + node] for node in [0, *commit.path]]
            off += vt.size
            seq.num_cached = q.ctx_len + 1 + len(commit.path)
            seq.draft_cached = q.ctx_len
            self.append_tokens(seq, tokens, rows)
            a = len(commit.path)
            self.totals["spec_verify_steps"] += 1
            self.totals["spec_draft_tokens"] += vt.size - 1
            self.totals["spec_accepted_tokens"] += a
            m["verify_steps"] = m.get("verify_steps", 0) + 1
            m["draft_tokens"] = m.get("draft_tokens", 0) + vt.size - 1
            m["accepted_tokens"] = m.get("accepted_tokens", 0) + a
            m.setdefault("accept_lengths", []).append(a + 1)
            for i in range(a):
                per_pos[i] += 1

    def take_report(self, stepped: bool = False):
        report = super().take_report(stepped)
        if report is not None:
            t = self.totals
            steps = t["spec_verify_steps"]
            report.stats |= t | {"spec_accept_length_mean":
                                 (steps + t["spec_accepted_tokens"]) / steps if steps else 0.0}
        return report


def make_spec_leader(config: EngineConfig, runner: ModelRunner, tp: TPGroup) -> SpecLeader:
    return SpecLeader(config, runner, tp)


def make_spec_follower(config: EngineConfig, runner: ModelRunner, tp: TPGroup):
    """A non-zero rank's speculative step: the same forwards, rank 0's decisions, the guard."""
    worker = SpecWorker(config, runner, tp)

    def step(plan: StepPlan) -> None:
        spec: SpecStep = plan.spec
        result = worker.run(spec, FollowerDecider(tp, config, len(spec.seqs)))
        maybe_check(config, tp, plan, _committed(spec, result.commits))

    return step
