"""The decisions of one speculative step, made on rank 0 and applied by every rank.

`DecisionChannel.sync` is the only way a decision crosses ranks: every rank calls it for every decision in the same
order and rank 0 supplies the value, so the collectives cannot drift. `SpecDecisions` holds what rank 0 alone knows
(draft scores, sampling state, the cost model).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.sampling.logits import filter_probs, prepare_logits
from worker.scheduler import Sequence

from . import budget
from .budget import Candidate, CostTable, Estimates
from .tree import DraftTree, VerifyTree, select_candidates
from .verify import verify_greedy, verify_sampling


@dataclass
class Commit:
    """One sequence's verify outcome: accepted tree nodes (by index) and the bonus token."""

    path: list[int]
    bonus: int


@dataclass
class Selection:
    """What one sequence verifies: draft-tree candidates (ancestors first) and how many context tokens."""

    picks: list[int]
    num_context: int


class DecisionChannel:
    """One int64 broadcast per decision; rank 0's value wins. Folds every value it hands out, with a running count,
    into a digest that the divergence guard compares across ranks (so a rank that applied anything else is caught
    at the next check)."""

    def __init__(self, tp: TPGroup, corrupt_step: int = 0):
        self.tp = tp
        self.count = 0
        self.digest = 0
        self.step = 0  # the plan step being run (set by the caller)
        self.seconds: dict[str, list[float]] = {}
        self.corrupt_step = corrupt_step  # test hook (--debug-corrupt-decision): alter this step's first draft value

    def sync(
        self, name: str, decide: Callable[[], torch.Tensor], shape: tuple[int, ...], local: bool = False
    ) -> torch.Tensor:
        """Rank 0 (or every rank, when `local`) calls `decide`; the others receive its [shape] int64 result."""
        if local or self.tp.is_leader:
            value = decide().to(torch.int64)
            assert tuple(value.shape) == shape, f"decision {name}: {tuple(value.shape)} != {shape}"
        else:
            value = torch.empty(shape, dtype=torch.int64)
        if self.tp.size > 1 and not local:
            t0 = time.perf_counter()
            self.tp.broadcast_tensor(value)
            self.seconds.setdefault(name, []).append(time.perf_counter() - t0)
            self.count += 1
        if self.corrupt_step and self.step == self.corrupt_step and name == "draft":
            value.view(-1)[0] += 1  # a different draft token, on this rank alone
            self.corrupt_step = 0
        h = hashlib.blake2b(self.digest.to_bytes(8, "little", signed=True) + name.encode(), digest_size=8)
        h.update(value.numpy().tobytes())
        self.digest = int.from_bytes(h.digest(), "little", signed=True)
        return value

    def state(self) -> list[int]:
        """What the guard compares besides the committed lengths: the decision digest and the collective count."""
        return [self.digest, self.count]


@dataclass
class LeaderState:
    """Rank 0's inputs to a step's decisions."""

    seqs: list[Sequence]
    head: object  # maps draft-vocabulary ids to target ids (FR-Spec subset, EAGLE-3 d2t)
    cost: CostTable | None  # None: the fixed tree every step
    estimates: Estimates
    chain_keys: list[tuple[int, int]]  # each sequence's chain's estimate key (`SpecLeader.chain`)


class SpecDecisions:
    def __init__(self, chan: DecisionChannel, config: EngineConfig, batch: int, leader: LeaderState | None):
        self.chan, self.config, self.batch, self.leader = chan, config, batch, leader
        self.spec = config.spec
        self.scores: list[list[float]] | None = None  # rank 0: the latest cumulative scores, per sequence
        self.conf: list[list[float]] | None = None  # rank 0: the latest draft probabilities, per sequence
        self.stopped_early = False

    def score(self, b: int, j: int) -> tuple[float, float]:
        """Rank 0: candidate j's cumulative score and the draft's own probability of its token."""
        return (self.scores[b][j], self.conf[b][j]) if self.scores is not None else (0.0, 0.0)

    def _calibrated(self, vals: torch.Tensor, depth: int) -> torch.Tensor:
        """Rank 0: the draft's top-k log-probabilities as the budget prices them (unchanged on a fixed tree)."""
        self.conf = vals.exp().reshape(self.batch, -1).tolist()
        lead = self.leader
        return vals if lead.cost is None else lead.estimates.calibration.logp(vals, depth)

    # --- drafting -----------------------------------------------------------------------------------------
    def first(self, logp: torch.Tensor, k: int) -> torch.Tensor:
        def decide():
            vals, idx = torch.topk(logp, k, dim=-1)
            self.scores = self._calibrated(vals.cpu(), 1).tolist()
            return self.leader.head.to_target_ids(idx).cpu()

        return self.chan.sync("draft", decide, (self.batch, k))

    def expand(self, logp: torch.Tensor, trees: list[DraftTree], k: int, last: bool, contexts: list[list[int]]):
        """Children of the frontier [B, k*k], the next frontier [B, k] (None on the last level), and whether
        rank 0 stops expanding here (no further level can pay for its draft forward)."""
        B = self.batch
        width = k * k if last else k * k + k + 1

        def decide():
            vals, idx = torch.topk(logp, k, dim=-1)  # [B, k(frontier), k(children)]
            parent = torch.tensor([[t.scores[c] for c in t.frontier] for t in trees])
            depth = trees[0].depths[trees[0].frontier[0]] + 1
            cum = (parent.unsqueeze(-1) + self._calibrated(vals.cpu(), depth)).view(B, k * k)
            self.scores = cum.tolist()
            children = self.leader.head.to_target_ids(idx).cpu().view(B, k * k)
            if last:
                return children
            picks = torch.topk(cum, k, dim=-1).indices
            stop = torch.full((B, 1), int(not self._worth_expanding(trees, cum, picks, contexts)))
            return torch.cat([children, picks, stop], dim=1)

        packed = self.chan.sync("draft", decide, (B, width))
        if last:
            return packed, None, True
        return packed[:, : k * k], packed[:, k * k : k * k + k], bool(packed[0, -1])

    def _worth_expanding(self, trees, cum: torch.Tensor, picks: torch.Tensor, contexts) -> bool:
        lead = self.leader
        if lead.cost is None:
            return True
        cands = self._eagle_candidates(trees) + self._context_candidates(contexts)
        cands += [Candidate(math.exp(s), b, budget.EAGLE, 1 << 30) for b, row in enumerate(cum.tolist()) for s in row]
        frontier = [(b, math.exp(cum[b, int(j)])) for b in range(self.batch) for j in picks[b]]
        est = lead.estimates
        step_s = est.draft_time(self.batch) / max(1, self.spec.num_steps)
        return budget.worth_expanding(
            cands,
            frontier,
            self.spec.eagle_topk,
            self.spec.num_draft_tokens - 1,
            self.batch,
            lead.cost,
            est.fixed(budget.DRAFT, self.batch),
            step_s,
        )

    # --- what to verify -----------------------------------------------------------------------------------
    def _eagle_candidates(self, trees: list[DraftTree]) -> list[Candidate]:
        num = self.spec.num_draft_tokens - 1
        return [
            Candidate(math.exp(t.scores[c]), b, budget.EAGLE, c)
            for b, t in enumerate(trees)
            for c in select_candidates(t, min(num, len(t.tokens)))
        ]

    def _context_candidates(self, contexts: list[list[int]]) -> list[Candidate]:
        lead = self.leader
        return [
            c
            for b, ctx in enumerate(contexts)
            for c in budget.context_candidates(b, len(ctx), lead.estimates.context_p(lead.chain_keys[b]))
        ]

    def select(self, trees: list[DraftTree], contexts: list[list[int]]) -> list[Selection]:
        num = self.spec.num_draft_tokens - 1
        width = 2 + num

        def decide():
            lead = self.leader
            if lead.cost is None:  # the full tree and every context candidate
                chosen = [
                    Selection(select_candidates(t, min(num, len(t.tokens))), len(c)) for t, c in zip(trees, contexts)
                ]
            else:
                cands = self._eagle_candidates(trees) + self._context_candidates(contexts)
                best, _ = budget.choose(cands, self.batch, lead.cost, lead.estimates.fixed(budget.DRAFT, self.batch))
                chosen = [
                    Selection(
                        sorted(c.index for c in best if c.seq == b and c.source == budget.EAGLE),
                        sum(1 for c in best if c.seq == b and c.source == budget.CONTEXT),
                    )
                    for b in range(self.batch)
                ]
            out = torch.full((self.batch, width), -1, dtype=torch.int64)
            for b, s in enumerate(chosen):
                out[b, 0], out[b, 1] = len(s.picks), s.num_context
                out[b, 2 : 2 + len(s.picks)] = torch.tensor(s.picks, dtype=torch.int64)
            return out

        rows = self.chan.sync("draft", decide, (self.batch, width)).tolist()
        return [Selection(row[2 : 2 + row[0]], row[1]) for row in rows]

    # --- accept ---------------------------------------------------------------------------------------------
    def accept(self, vtrees: list[VerifyTree], logits: torch.Tensor, max_depth: int) -> list[Commit]:
        width = 2 + max_depth
        local = self.config.debug_skip_decision_broadcast

        def decide():
            commits = self._local_greedy(vtrees, logits) if local else self._decide_accept(vtrees, logits)
            out = torch.full((len(commits), width), -1, dtype=torch.int64)
            for b, c in enumerate(commits):
                out[b, 0], out[b, 1] = len(c.path), c.bonus
                out[b, 2 : 2 + len(c.path)] = torch.tensor(c.path, dtype=torch.int64)
            return out

        rows = self.chan.sync("verify", decide, (self.batch, width), local=local).tolist()
        return [Commit(row[2 : 2 + row[0]], row[1]) for row in rows]

    @staticmethod
    def _local_greedy(vtrees: list[VerifyTree], logits: torch.Tensor) -> list[Commit]:
        """A rank's own decision from its own logits: what ranks do without the broadcast (the bug)."""
        commits, off = [], 0
        for vt in vtrees:
            rows = logits[off : off + vt.size]
            path, bonus = verify_greedy(vt, lambda node, _toks, rows=rows: int(torch.argmax(rows[node])))
            commits.append(Commit(path, bonus))
            off += vt.size
        return commits

    def _decide_accept(self, vtrees: list[VerifyTree], logits: torch.Tensor) -> list[Commit]:
        spec = self.spec
        commits, off = [], 0
        for seq, vt in zip(self.leader.seqs, vtrees):
            rows = logits[off : off + vt.size]
            off += vt.size
            p = seq.params

            def processed(node: int, path_tokens: list[int], rows=rows, seq=seq) -> torch.Tensor:
                return prepare_logits(seq, rows[node], path_tokens)

            if p.greedy and not p.adjusts_logits and seq.grammar is None:  # every node's choice in one call
                best = rows.argmax(dim=-1).tolist()
                path, bonus = verify_greedy(vt, lambda node, _toks, best=best: best[node])
            elif p.greedy:
                path, bonus = verify_greedy(vt, lambda node, toks, f=processed: int(torch.argmax(f(node, toks))))
            else:
                path, bonus = verify_sampling(
                    vt,
                    lambda node, toks, f=processed, p=p: filter_probs(f(node, toks), p),
                    seq.generator,
                    spec.accept_threshold_single,
                    spec.accept_threshold_acc,
                )
            if seq.grammar is not None:  # the walk advanced the matcher; committing the tokens advances it for real
                seq.grammar.end_speculation()
            if p.greedy and self.leader.cost is not None:
                self._observe_calibration(vt, path, bonus)
            commits.append(Commit(path, bonus))
        return commits

    def _observe_calibration(self, vt: VerifyTree, path: list[int], bonus: int) -> None:
        """The EAGLE children of the root and of each accepted node against the target's choice there: the
        next accepted token, or the bonus after the last."""
        cal = self.leader.estimates.calibration
        wants = [vt.tokens[n] for n in path] + [bonus]
        kids = vt.children()
        for parent, want in zip([0, *path], wants):
            for n in kids[parent]:
                if vt.sources[n] & budget.EAGLE:
                    cal.observe(vt.depths[n], vt.conf[n], vt.tokens[n] == want)
