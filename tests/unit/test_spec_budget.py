"""Rank 0's cost-aware tree and the free drafts, piece by piece without an engine: the choices follow the cost table."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from speculative import budget
from speculative.budget import Calibration, Candidate, CostGrid, CostTable, Estimates
from speculative.context import context_draft
from speculative.corpus import Corpus
from speculative.decisions import LeaderState, SpecDecisions
from speculative.defaults import default_spec_config
from speculative.tree import DraftTree, VerifyTree, build_verify_tree, draft_only_accepted
from speculative.worker import batch_limit, calibration_batches, check_tree_width
from worker.config import EngineConfig, SpecConfig

FLAT = {"verify_seconds": {"1": 0.01, "64": 0.01}}  # verifying is free: every candidate pays
STEEP = {"verify_seconds": {"1": 0.01, "2": 1.0}}  # a second row costs 100 steps: nothing pays


def test_context_draft_follows_the_latest_full_match():
    assert context_draft([5, 6, 7, 8, 9, 5, 6], 3, 3) == ([7, 8, 9], 2)
    assert context_draft([1, 2, 3, 1, 2, 4, 1, 2], 3, 1) == ([4], 2)  # the latest of two matches
    assert context_draft([1, 1, 1, 1, 1, 1, 1, 1, 1], 3, 4) == ([1, 1, 1, 1], 3)  # periodic: an earlier full match
    assert context_draft([3, 4, 5], 3, 4) == ([], 0)


# five answers sharing "2 3 4 5", then 6 in four of them
ANSWERS = [
    [1, 2, 3, 4, 5, 6],
    [9, 2, 3, 4, 5, 7],
    [8, 2, 3, 4, 5, 6, 10],
    [7, 2, 3, 4, 5, 6, 11],
    [6, 2, 3, 4, 5, 6, 11],
]


def test_corpus_draft_follows_the_longest_match_while_its_occurrences_agree():
    c = Corpus(ANSWERS)
    assert c.key_len == 4
    assert c.draft([1, 2, 3, 4, 5], 4) == ([6], 1, 5)  # the longest suffix occurs once; its answer ends after 6
    assert c.draft([0, 2, 3, 4, 5], 4) == ([6], 4, 4)  # 4 of 5 occurrences go on with 6, then they part (10, 11, 11)
    assert c.draft([0, 7, 2, 3, 4, 5, 6], 4) == ([11], 1, 6)
    assert c.draft([9, 2, 3, 4, 5], 4) == ([7], 1, 5)
    assert c.draft([2, 3, 4, 9], 4) == ([], 0, 0)  # no suffix occurs with a token after it


def test_a_corpus_match_shorter_than_the_key_offers_a_majority_token():
    c = Corpus(ANSWERS)
    # "4 5" occurs five times, followed by 6 four times (a majority), then the occurrences part (end, 10, 11, 11)
    assert c.draft([4, 5], 4) == ([6], 4, 2)
    assert c.draft([0, 0, 4, 5], 4) == ([6], 4, 2)  # the whole key does not occur: the longest suffix that does
    assert c.draft([1 << 20, 4, 5], 4) == ([6], 4, 2)  # a token past the index's bits ends the suffix
    assert c.draft([0, 5, 6], 4) == ([11], 2, 2)  # "5 6" goes on with 10, 11, 11 (where it ends an answer, no window)
    # "4" is always followed by 5, then "4 5" by 6 at MIN_SHARE: the chain goes on as a whole-key match's does
    assert c.draft([2, 3, 4, 4], 4) == ([5, 6], 5, 1)
    assert c.draft([0, 5, 7], 4) == ([], 0, 0)  # "7" goes on only where it opens an answer: not a whole window


def test_a_chain_is_chosen_by_the_tokens_it_promises():
    """The context's long chain against the corpus's two tokens after a one-token match: the likelier first token
    does not decide, the expected accepted tokens (p + p^2 + ...) do."""
    from types import SimpleNamespace

    from speculative.leader import SpecLeader

    spec = default_spec_config()
    tokens = [10, *range(11, 11 + spec.context_tokens), 10]  # 10 was followed by a whole chain before
    leader = SimpleNamespace(
        config=EngineConfig(spec=spec), estimates=Estimates(eagle_prior=1.0), corpus=Corpus([[5, 6, 7, 10, 99, 98]])
    )
    ctx, n = context_draft(tokens, spec.context_ngram, spec.context_tokens)
    assert len(ctx) == spec.context_tokens >= 5 and n == 1  # 5 tokens at 0.5 promise 0.97 > 0.6 + 0.36
    assert leader.corpus.draft(tokens, spec.context_tokens) == ([99, 98], 1, 1)
    est = leader.estimates
    est.context_hits[(budget.CORPUS, -1)], est.context_trials[(budget.CORPUS, -1)] = 5.0, 8.0  # p 0.6
    # the context's p is 0.5: 0.5 + 0.25 + ... beats 0.6 + 0.36, though 0.6 > 0.5 for the first token
    assert SpecLeader.chain(leader, tokens) == (ctx, (budget.CONTEXT, 1))
    est.context_hits[(budget.CONTEXT, 1)], est.context_trials[(budget.CONTEXT, 1)] = 2.0, 8.0  # p 0.3: 0.43 in all
    assert SpecLeader.chain(leader, tokens) == ([99, 98], (budget.CORPUS, -1))


def test_the_default_corpus_is_the_committed_distilled_answers():
    from speculative.corpus import DISTILLED, DISTILLED_ANSWERS, DISTILLED_GPU, corpus_folders

    assert DISTILLED_ANSWERS == (DISTILLED.resolve(), DISTILLED_GPU.resolve())
    spec = default_spec_config()
    assert corpus_folders(EngineConfig(spec=spec)) == list(DISTILLED_ANSWERS)
    assert corpus_folders(EngineConfig(model_path="/elsewhere/model.gguf", spec=spec)) == []  # not its answers
    assert corpus_folders(EngineConfig(spec=dataclasses.replace(spec, corpus="off"))) == []


def test_choose_verifies_what_pays_and_nothing_else():
    cands = [
        Candidate(0.9, 0, budget.EAGLE, 0),
        Candidate(0.5, 0, budget.CONTEXT, 0),
        Candidate(0.05, 0, budget.EAGLE, 1),
    ]
    flat, steep = CostTable.from_json(FLAT), CostTable.from_json(STEEP)
    assert len(budget.choose(cands, 1, flat, 0.0)[0]) == 3
    assert budget.choose(cands, 1, steep, 0.0)[0] == []
    # 10 ms for the root, +1 ms a row: 0.9 and 0.5 pay for their row, 0.05 does not
    linear = CostTable((1, 11), (0.010, 0.020))
    assert [c.prob for c in budget.choose(cands, 1, linear, 0.0)[0]] == [0.9, 0.5]


def test_plan_step_picks_plain_when_drafting_cannot_pay():
    est = Estimates(eagle_prior=4.0)
    ctx = [budget.context_candidates(0, 3, 0.5)]
    assert budget.plan_step(est, CostTable.from_json(STEEP), ctx, 4)[0] == budget.PLAIN
    assert budget.plan_step(est, CostTable.from_json(FLAT), ctx, 4)[0] == budget.DRAFT
    est.eagle_gain = {False: 0.0, True: 0.0}  # a head that never hits: free context candidates alone
    assert budget.plan_step(est, CostTable.from_json(FLAT), ctx, 4) == (budget.CONTEXT_ONLY, [3])


def test_a_draft_beside_a_chain_is_priced_by_what_it_adds():
    """Beside a free chain a draft earns only the tokens the chain did not also propose: with the head adding little
    there, rank 0 drafts for a sequence without a chain and verifies the chain alone for one with it."""
    est = Estimates(eagle_prior=1.0)
    table = CostTable((1, 2, 3), (0.010, 0.014, 0.018))  # a row pays above 0.4 accepted tokens
    for kind in (budget.PLAIN, budget.DRAFT, budget.CONTEXT_ONLY):
        est.observe_step(kind, 1, 0.001)
    est.observe_draft(1, 0.001, [(False, 1)] * 20 + [(True, 0)] * 20)
    assert est.eagle_gain[False] > 0.9 and est.eagle_gain[True] < 0.1
    assert budget.plan_step(est, table, [[]], 1)[0] == budget.DRAFT
    assert budget.plan_step(est, table, [budget.context_candidates(0, 1, 0.6)], 1) == (budget.CONTEXT_ONLY, [1])


def test_only_draft_only_tokens_count_as_what_drafting_added():
    t = DraftTree()
    t.add(11, -1, -0.1)
    merged = build_verify_tree(7, t, [0], [11, 12])  # the chain repeats the draft token: one shared node
    assert merged.sources[1] == budget.EAGLE | budget.CONTEXT and draft_only_accepted(merged, [1, 2]) is None
    t2 = DraftTree()
    t2.add(31, -1, -0.1)
    apart = build_verify_tree(7, t2, [0], [11, 12])  # the draft proposes another first token
    assert draft_only_accepted(apart, [1]) == 1 and draft_only_accepted(apart, [2, 3]) == 0


def test_a_kind_priced_out_by_one_slow_step_is_tried_again():
    """Overheads are measured only when their kind runs: a single slow draft step must not stop drafting for good,
    and a kind the probes keep finding slower is probed ever less often."""
    est = Estimates(eagle_prior=1.0)
    flat = CostTable.from_json(FLAT)
    est.observe_step(budget.PLAIN, 1, 0.001)
    est.observe_step(budget.DRAFT, 1, 0.5)  # one spike: half a second besides the verify
    kinds = []
    for _ in range(4 * budget.PROBE_AFTER):
        kind, _ = budget.plan_step(est, flat, [[]], 1)
        kinds.append(kind)
        est.chose(kind, 1)
    drafted = [i for i, k in enumerate(kinds) if k == budget.DRAFT]
    assert drafted == [budget.PROBE_AFTER, 3 * budget.PROBE_AFTER + 1]  # then twice as long


def test_a_head_measured_below_paying_is_drafted_again_only_by_probes():
    """Where the draft's measured acceptance does not pay for its rows (a wide batch on a CPU whose verify cost grows
    with every row), drafting is retried only at the probes' backed-off interval: a step passed over does not move
    the estimate back to the optimistic prior."""
    est = Estimates(eagle_prior=1.0)
    table = CostTable((1, 2), (0.010, 0.015))  # a draft step pays above 0.45 accepted tokens
    est.observe_step(budget.PLAIN, 1, 0.001)
    est.observe_step(budget.DRAFT, 1, 0.001)
    assert budget.plan_step(est, table, [[]], 1)[0] == budget.DRAFT  # the optimistic prior: try it
    est.chose(budget.DRAFT, 1)
    est.observe_draft(1, 0.001, [(False, 0)] * 10)  # measured: the head's tokens are rejected
    kinds = []
    for _ in range(4 * budget.PROBE_AFTER):
        kind, _ = budget.plan_step(est, table, [[]], 1)
        kinds.append(kind)
        est.chose(kind, 1)
        if kind == budget.DRAFT:
            est.observe_draft(1, 0.001, [(False, 0)])
    assert [i for i, k in enumerate(kinds) if k == budget.DRAFT] == [budget.PROBE_AFTER, 3 * budget.PROBE_AFTER + 1]


def test_a_probe_that_measures_a_normal_step_brings_drafting_back():
    est = Estimates(eagle_prior=1.0)
    flat = CostTable.from_json(FLAT)
    est.observe_step(budget.PLAIN, 1, 0.001)
    for _ in range(3):
        est.observe_step(budget.DRAFT, 1, 0.5)  # a slow spell: three steps
    for _ in range(budget.PROBE_AFTER):
        kind, _ = budget.plan_step(est, flat, [[]], 1)
        assert kind == budget.PLAIN
        est.chose(kind, 1)
    assert budget.plan_step(est, flat, [[]], 1)[0] == budget.DRAFT  # the probe
    est.chose(budget.DRAFT, 1)
    est.observe_step(budget.DRAFT, 1, 0.001)  # the spell is over: the probe's figure replaces the old ones
    assert est.fixed(budget.DRAFT, 1) == 0.001
    assert budget.plan_step(est, flat, [[]], 1)[0] == budget.DRAFT


def test_a_cost_table_file_is_never_probed():
    est = Estimates(eagle_prior=1.0, frozen={budget.DRAFT: 0.5})
    steep = CostTable.from_json(STEEP)
    for _ in range(4 * budget.PROBE_AFTER):
        kind, _ = budget.plan_step(est, steep, [[]], 1)
        assert kind == budget.PLAIN
        est.chose(kind, 1)


def test_with_a_cost_table_file_a_measured_head_is_drafted_again_by_probes():
    """A file's overheads are never re-measured, but the EAGLE acceptance is: once drafting measured it below paying,
    a probe drafts again at the backed-off interval (else a stretch of rejected drafts would end drafting for good)."""
    est = Estimates(eagle_prior=1.0, frozen={})
    table = CostTable((1, 2), (0.010, 0.015))  # a draft step pays above 0.5 accepted tokens
    assert budget.plan_step(est, table, [[]], 1)[0] == budget.DRAFT
    est.chose(budget.DRAFT, 1)
    est.observe_draft(1, 0.001, [(False, 0)] * 10)
    kinds = []
    for _ in range(4 * budget.PROBE_AFTER):
        kind, _ = budget.plan_step(est, table, [[]], 1)
        kinds.append(kind)
        est.chose(kind, 1)
    assert [i for i, k in enumerate(kinds) if k == budget.DRAFT] == [budget.PROBE_AFTER, 3 * budget.PROBE_AFTER + 1]


def test_one_slow_step_does_not_move_a_kinds_price():
    est = Estimates(eagle_prior=1.0)
    for seconds in (0.002, 0.002, 0.5, 0.002, 0.003):  # a page fault in the middle
        est.observe_step(budget.DRAFT, 4, seconds)
    assert est.fixed(budget.DRAFT, 4) == 0.002
    assert est.fixed(budget.DRAFT, 8) == 0.002  # the nearest batch measured, until batch 8 is


GRID = CostGrid(
    contexts=(64, 512),
    batches=(1, 8),
    per_seq=(1, 2),
    seconds=(
        ((0.010, 0.011), (0.014, 0.020)),  # context 64: batch 1, batch 8
        ((0.011, 0.012), (0.020, 0.032)),
    ),
)  # context 512


def test_the_cost_grid_prices_rows_by_batch_and_context():
    assert GRID.at(1, 64).rows == (1, 2) and GRID.at(1, 64).seconds == pytest.approx((0.010, 0.011))
    assert GRID.at(8, 512).rows == (8, 16) and GRID.at(8, 512).seconds == pytest.approx((0.020, 0.032))
    mid = GRID.at(8, 288)  # halfway between the measured contexts
    assert mid.rows == (8, 16) and mid.seconds == pytest.approx((0.017, 0.026))
    wide = GRID.at(15, 64)  # beyond the widest measured batch: linear
    assert wide.rows == (15, 30) and wide.seconds == pytest.approx((0.018, 0.029))
    assert wide.verify(20) > wide.verify(15)  # between the points: by rows
    long = GRID.at(1, 960)  # beyond the longest context: linear
    assert long.seconds == pytest.approx((0.012, 0.013))


def test_a_noisy_grid_never_falls_with_rows_batch_or_context():
    noisy = CostGrid(
        contexts=(64, 512),
        batches=(1, 8),
        per_seq=(1, 2),
        seconds=(
            ((0.010, 0.009), (0.014, 0.020)),  # two rows measured cheaper than one
            ((0.011, 0.012), (0.013, 0.030)),
        ),
    )  # batch 8 at 512 cheaper than at 64
    assert noisy.seconds == (((0.010, 0.010), (0.014, 0.020)), ((0.011, 0.012), (0.014, 0.030)))
    assert noisy.at(8, 4096).seconds[0] >= noisy.at(8, 64).seconds[0]  # extrapolation never falls
    with pytest.raises(ValueError):
        CostGrid((64,), (1,), (1,), (((0.0,),),))


def test_rows_past_the_timed_ones_never_extrapolate_below_the_timings():
    # a wide batch of a tiny model on a loaded CI machine: 5 rows timed faster than 3 by noise; linear extrapolation
    # of the raw timings put 10 rows at -1.5 ms and start-up failed ("a cost grid's seconds must be positive"); the
    # raised timings' last slope is flat, so 10 rows follow the whole span's slope (0.25 ms a row) instead
    row = budget.timed_row({1: 0.0010, 2: 0.0011, 3: 0.0020, 5: 0.0010}, (1, 2, 3, 5, 10))
    assert row == pytest.approx((0.0010, 0.0011, 0.0020, 0.0020, 0.00325))
    assert budget.timed_row({1: 0.001, 3: 0.002}, (1, 2, 3, 5)) == pytest.approx((0.001, 0.0015, 0.002, 0.003))


@pytest.mark.parametrize(
    "max_running, limit, batches",
    [(64, 9, (1, 2, 4, 8)), (64, 0, (1, 2, 4, 8, 16)), (64, 5, (1, 2, 4)), (64, 2, (1,)), (3, 0, (1, 2))],
)
def test_calibration_times_the_batches_that_can_speculate(max_running, limit, batches):
    assert calibration_batches(max_running, limit) == batches


def _grid(ms: dict[int, tuple[float, float]]) -> CostGrid:
    """A calibration grid from {batch: (ms for one row per sequence, ms for two)}, the same at both contexts."""
    rows = tuple((one / 1000, two / 1000) for one, two in ms.values())
    return CostGrid(contexts=(64, 512), batches=tuple(ms), per_seq=(1, 2), seconds=(rows, rows))


def test_the_default_batch_limit_follows_the_measured_cost_of_a_second_row():
    """Start-up timings (context 64, ms) of a CPU without AMX, where a second row per sequence costs over
    SECOND_ROW_LIMIT at batch 4, and of one with AMX, where it stays under it up to batch 8. The shipped default's
    limit of 9 is lowered to the first batch size past the rule only."""
    no_amx = _grid({1: (5.23, 5.23), 2: (5.23, 6.39), 4: (6.62, 11.04), 8: (11.80, 19.72)})
    amx = _grid({1: (7.95, 7.98), 2: (8.17, 9.30), 4: (9.68, 11.33), 8: (11.88, 15.95)})
    assert batch_limit(no_amx, 9) == 4 and batch_limit(no_amx, 0) == 4
    assert batch_limit(amx, 9) == 9 and batch_limit(amx, 0) == 0  # never raised, nor set where every size pays
    assert batch_limit(no_amx, 3) == 3  # a lower limit stands
    assert batch_limit(_grid({1: (5.0, 9.0), 2: (9.0, 12.0)}), 9) == 9  # batch 1 is the budget's alone
    # a second row at 1.45x one row at batch 4 is past the rule, so 4 sequences decode plainly
    assert batch_limit(_grid({1: (5.5, 5.6), 2: (6.9, 8.2), 4: (9.14, 13.27), 8: (14.9, 25.1)}), 9) == 4


def test_a_tree_wider_than_the_triton_bitmask_is_refused_at_start_up():
    """The Triton kernels carry a tree row's nodes in one int64 (63 nodes): a wider tree is a clear start-up error
    there, where it would otherwise trip an assert in the first step (or the calibration) that builds one."""
    wide = SpecConfig("EAGLE3", num_steps=4, eagle_topk=1, num_draft_tokens=5, context_tokens=59)
    check_tree_width(wide, "torch")  # the reference path takes any tree
    check_tree_width(dataclasses.replace(wide, context_tokens=58), "triton")  # 63 nodes: the widest that fits
    with pytest.raises(ValueError, match="at most 63"):
        check_tree_width(wide, "triton")
    with pytest.raises(ValueError, match="draft levels 8 x topk 8"):
        check_tree_width(
            SpecConfig("EAGLE3", num_steps=9, eagle_topk=8, num_draft_tokens=16, context_tokens=0), "triton"
        )


def test_a_wide_batch_decodes_plainly_where_one_sequence_drafts():
    """Per row, a batch of 8 verifies at more than twice one sequence's cost (measured: bench/spec_batch.py); with
    the same estimates, rank 0 drafts for one sequence and takes plain steps for eight."""
    est = Estimates(eagle_prior=1.0)
    est.eagle_gain = {False: 0.5, True: 0.5}
    for batch in (1, 8):
        est.observe_step(budget.DRAFT, batch, 0.002 * batch)
        est.observe_step(budget.PLAIN, batch, 0.0005)
    assert budget.plan_step(est, GRID.at(1, 300), [[]], 1)[0] == budget.DRAFT
    assert budget.plan_step(est, GRID.at(8, 300), [[]] * 8, 1)[0] == budget.PLAIN


def test_context_chain_merges_into_the_draft_tree():
    t = DraftTree()
    a = t.add(11, -1, -0.1)
    t.add(12, a, -0.2)
    t.add(21, -1, -2.0)
    vt = build_verify_tree(7, t, [0, 1, 2], [11, 12, 13])
    assert vt.tokens == [7, 11, 12, 21, 13] and vt.parents == [-1, 0, 1, 0, 2]
    assert vt.sources == [0, budget.EAGLE | budget.CONTEXT, budget.EAGLE | budget.CONTEXT, budget.EAGLE, budget.CONTEXT]


def test_calibration_learns_what_the_draft_confidence_is_worth_at_each_depth():
    cal = Calibration(3)
    logp = torch.tensor([[-0.4, -1.5, -3.0]])  # a top-3 holding 0.94 of the mass
    assert torch.allclose(cal.logp(logp, 1), logp)  # trusted until measured
    for i in range(2000):  # an under-confident head at depth 1: says 0.55, is right 75% of the time
        cal.observe(1, 0.55, i % 4 != 0)
    for i in range(2000):  # an over-confident one at depth 3: says 0.95, is right half the time
        cal.observe(3, 0.95, i % 2 == 0)
    assert cal.prob(0.55, 1) == pytest.approx(0.75, abs=0.01) and cal.prob(0.95, 3) == pytest.approx(0.5, abs=0.02)
    assert cal.prob(0.45, 1) == pytest.approx(0.45) and 0.45 < cal.prob(0.5, 1) < cal.prob(0.55, 1)  # rising
    assert cal.prob(0.55, 2) == pytest.approx(0.55) and cal.prob(0.15, 1) == pytest.approx(0.15)  # unmeasured
    siblings = cal.logp(torch.tensor([0.55, 0.4]).log(), 1).exp()  # exclusive events: at most 1 together
    assert siblings.sum() == pytest.approx(1.0) and siblings[0] > siblings[1]
    assert cal.summary()[1] == {"observed": 2000.0, "confidence": 0.55, "accepted": 0.75} and 2 not in cal.summary()
    for _ in range(2 * int(budget.CALIBRATION_WINDOW)):  # the text changes: the head is now right every time
        cal.observe(1, 0.55, True)
    assert cal.summary()[1]["observed"] <= budget.CALIBRATION_WINDOW + 1
    assert cal.prob(0.55, 1) > 0.9
    for _ in range(20000):  # steps on which nothing at depth 1 is verified: the draft's own word comes back
        cal.fade()
    assert cal.prob(0.55, 1) == pytest.approx(0.55, abs=0.01)


class _Chan:  # rank 0 alone: a decision is what rank 0 decides
    def sync(self, name, decide, shape, local=False):
        return decide()


class _Head:
    @staticmethod
    def to_target_ids(idx):
        return idx + 100


def _decisions(cost) -> SpecDecisions:
    lead = LeaderState([], _Head(), cost, Estimates(eagle_prior=2.0, calibration=Calibration(3)), [])
    return SpecDecisions(_Chan(), EngineConfig(), 1, lead)


def test_draft_confidence_follows_each_candidate_and_the_greedy_walk_observes_it():
    """Each drafted child keeps the draft's own probability beside its cumulative score; after a verify, the EAGLE
    children of the root and of each accepted node are observed against the target's choice there, and nothing else."""
    dec = _decisions(cost=None)
    first = torch.tensor([[0.6, 0.3, 0.1]]).log()
    assert dec.first(first, 2).tolist() == [[100, 101]]
    tree = DraftTree()
    for j in range(2):
        tree.add(100 + j, -1, *dec.score(0, j))
    tree.frontier = [0, 1]
    assert tree.conf == pytest.approx([0.6, 0.3]) and tree.scores == pytest.approx([math.log(0.6), math.log(0.3)])
    level = torch.tensor([[[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]]]).log()  # [batch, frontier, vocabulary]
    children, picks, _ = dec.expand(level, [tree], 2, False, [[]])
    assert children.tolist() == [[100, 102, 102, 100]]  # frontier-major: j * k + m
    assert [dec.score(0, i)[1] for i in range(4)] == pytest.approx([0.5, 0.3, 0.8, 0.1])
    assert dec.score(0, 2)[0] == pytest.approx(math.log(0.3 * 0.8))
    vt = VerifyTree(
        [7, 11, 12, 13, 14, 15],
        [-1, 0, 0, 1, 3, 2],
        [0, 1, 1, 2, 3, 2],
        [0, budget.EAGLE, budget.EAGLE, budget.EAGLE, budget.CONTEXT, budget.EAGLE],
        [0.0, 0.6, 0.3, 0.5, 0.0, 0.4],
    )
    dec = _decisions(cost=CostTable.from_json(FLAT))
    dec._observe_calibration(vt, [1, 3], 99)  # 11 then 13 accepted, then the target chose 99
    cal = dec.leader.estimates.calibration
    assert cal.trials == [[0, 0, 0, 1, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0, 0, 0], [0] * 10]
    assert cal.hits == [[0, 0, 0, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0, 0, 0], [0] * 10]


def test_calibrated_confidence_prices_the_tree():
    """An under-confident head's candidates, priced at its word, do not pay for their rows; calibrated, they do."""
    cost = CostTable((1, 2, 8), (0.010, 0.0125, 0.03))
    est = Estimates(eagle_prior=4.0, calibration=Calibration(1))
    cands = lambda: [Candidate(est.calibration.prob(0.25, 1), 0, budget.EAGLE, i) for i in range(4)]
    assert budget.choose(cands(), 1, cost, 0.0)[0] == []
    for _ in range(1000):
        est.calibration.observe(1, 0.25, True)
    assert len(budget.choose(cands(), 1, cost, 0.0)[0]) == 4
