"""Rank 0's cost-aware tree: how many candidates to verify, whether to draft at all, when to stop expanding.

Each candidate has an estimated acceptance probability (calibrated draft confidence along its path, or p_n^depth for
a chain); r verify rows cost `verify(r)` seconds, timed at start-up. Rank 0 verifies the best-first prefix that
maximises expected tokens per second (none: a plain decode).
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

DRAFT, CONTEXT_ONLY, PLAIN = "draft", "context", "plain"  # the kinds of decode step rank 0 chooses between
EMA = 0.2  # weight of a new measurement in the running estimates
OVERHEAD_WINDOW = 5  # a kind's overhead is the median of its last this many steps: one slow step does not move it
PROBE_AFTER = 64  # steps at a batch size after which a speculative kind passed over is run once to be re-measured
PROBE_MAX = 1024  # the longest probe interval, after probes that keep finding the kind slower


@dataclass(frozen=True)
class CostTable:
    """Target forward seconds by rows (piecewise linear between measured points, linear beyond the last)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    # a table from a file is the whole truth: each kind of step's seconds besides its verify (0 when not given),
    # instead of the running measurement a calibrated table is paired with
    overhead: dict[str, float] | None = None

    def verify(self, rows: float) -> float:
        return self.seconds[0] if rows <= self.rows[0] else interpolate(self.rows, self.seconds, rows)

    @classmethod
    def from_json(cls, data: dict) -> CostTable:
        """{"verify_seconds": {rows: seconds, ...}, "overhead_seconds": {"draft"|"context"|"plain": seconds}}"""
        points = sorted((int(r), float(s)) for r, s in data.get("verify_seconds", {}).items())
        if not points or any(r < 1 or s <= 0 for r, s in points):
            raise ValueError("a cost table needs verify_seconds: {rows >= 1: seconds > 0, ...}")
        overhead = {str(k): float(v) for k, v in data.get("overhead_seconds", {}).items()}
        if set(overhead) - {DRAFT, CONTEXT_ONLY, PLAIN}:
            raise ValueError(f"overhead_seconds keys are {DRAFT}, {CONTEXT_ONLY} and {PLAIN}")
        return cls(tuple(r for r, _ in points), tuple(s for _, s in points), overhead)

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_json(json.loads(Path(path).read_text()))

    def at(self, batch: int, context: float) -> CostTable:
        """A table from a file prices rows alone, whatever the batch and context."""
        return self

    def as_ms(self) -> dict[str, float]:
        return {str(r): round(1000 * x, 3) for r, x in zip(self.rows, self.seconds)}


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...] | list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), linear beyond both ends (a single point: constant)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def timed_row(timed: dict[int, float], per_seq: tuple[int, ...]) -> tuple[float, ...]:
    """Seconds for each of per_seq's row counts from those timed: each timing first raised to those of fewer rows
    (two tiny timings that fall by noise would extrapolate to a negative cost), then linear between them, and beyond
    the last at the steeper of the last two's slope and the whole span's (so one high timing before the last does
    not price every wider tree at the last timing)."""
    xs = tuple(sorted(timed))
    ys = list(itertools.accumulate((timed[r] for r in xs), max))
    if len(xs) < 2:
        return tuple(ys[0] for _ in per_seq)
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), (ys[-1] - ys[0]) / (xs[-1] - xs[0]))
    return tuple(interpolate(xs, ys, r) if r <= xs[-1] else ys[-1] + slope * (r - xs[-1]) for r in per_seq)


@dataclass(frozen=True)
class CostGrid:
    """Verify seconds timed at start-up: seconds[c][b][r] for contexts[c] tokens behind each of batches[b]
    sequences verifying per_seq[r] rows each. Rows cost more in a wider batch and behind a longer context, so one
    sequence at a short context would price a batch of 8 at 300 tokens a third too cheap (bench/spec_batch.py)."""

    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    per_seq: tuple[int, ...]
    seconds: tuple[tuple[tuple[float, ...], ...], ...]
    overhead = None  # the overheads of a calibrated grid are measured as it serves (Estimates)

    def __post_init__(self):
        """A forward of more rows, a wider batch or a longer context never costs less: each cell is raised to its
        smaller neighbours' maximum, so noise cannot make a slope negative and no extrapolation falls."""
        grid = [[list(row) for row in plane] for plane in self.seconds]
        if min(x for plane in grid for row in plane for x in row) <= 0:
            raise ValueError("a cost grid's seconds must be positive")
        for c, plane in enumerate(grid):
            for b, row in enumerate(plane):
                for r in range(len(row)):
                    row[r] = max(
                        [row[r]]
                        + ([row[r - 1]] if r else [])
                        + ([plane[b - 1][r]] if b else [])
                        + ([grid[c - 1][b][r]] if c else [])
                    )
        object.__setattr__(self, "seconds", tuple(tuple(tuple(row) for row in plane) for plane in grid))

    def at(self, batch: int, context: float) -> CostTable:
        """The verify cost by total rows for `batch` sequences of `context` tokens on average: linear between
        and beyond the measured batches and contexts, never falling as rows grow."""
        by_ctx = [
            [
                interpolate(self.batches, [self.seconds[c][b][r] for b in range(len(self.batches))], batch)
                for r in range(len(self.per_seq))
            ]
            for c in range(len(self.contexts))
        ]
        seconds, floor = [], self.seconds[0][0][0]  # the cheapest cell (the grid only rises)
        for r in range(len(self.per_seq)):
            s = max(floor, interpolate(self.contexts, [by_ctx[c][r] for c in range(len(self.contexts))], context))
            seconds.append(max(s, seconds[-1]) if seconds else s)
        return CostTable(tuple(batch * r for r in self.per_seq), tuple(seconds))

    def as_ms(self) -> dict[str, dict[str, dict[str, float]]]:
        """{"context N": {"batch B": {rows per sequence: ms}}}, for /engine/stats."""
        return {
            f"context {c}": {
                f"batch {b}": {str(r): round(1000 * x, 3) for r, x in zip(self.per_seq, row)}
                for b, row in zip(self.batches, plane)
            }
            for c, plane in zip(self.contexts, self.seconds)
        }


@dataclass(frozen=True)
class Candidate:
    prob: float  # estimated probability that the target accepts it (and its ancestors)
    seq: int  # index in the batch
    source: int  # EAGLE or CONTEXT (a chain, from the context or the corpus)
    index: int  # EAGLE: draft-tree candidate; CONTEXT: position in the chain (0-based)


# candidate sources, as bits of VerifyTree.sources: a sequence's chain comes from its context or from the corpus
EAGLE, CONTEXT, CORPUS = 1, 2, 4


def choose(cands: list[Candidate], batch: int, cost: CostTable, fixed_s: float) -> tuple[list[Candidate], float]:
    """The best-first prefix of `cands` maximising (batch + sum of probs) / (fixed_s + verify(batch + rows)).

    Probabilities never rise from a candidate to its descendants, and ties go to the lower index (the ancestor),
    so every prefix is closed under ancestors. Returns (chosen, expected tokens per second)."""
    order = sorted(cands, key=lambda c: (-c.prob, c.seq, c.source, c.index))
    tokens, best_m = float(batch), 0
    best = tokens / (fixed_s + cost.verify(batch))
    for m, c in enumerate(order, start=1):
        tokens += c.prob
        rate = tokens / (fixed_s + cost.verify(batch + m))
        if rate > best:
            best, best_m = rate, m
    return order[:best_m], best


CALIBRATION_BINS = 10  # confidence bins per draft depth
CALIBRATION_PRIOR = 50.0  # pseudo-observations at the draft's own word: it is trusted until measured
CALIBRATION_WINDOW = 5000.0  # per bin, older observations are scaled down past this many (the text drifts)
CALIBRATION_FADE = 0.9995  # per step: evidence older than a few thousand steps counts for little
CALIBRATION_FLOOR = 1e-6


def _bin(p: float) -> int:
    return min(max(int(p * CALIBRATION_BINS), 0), CALIBRATION_BINS - 1)


@dataclass
class Calibration:
    """Rank 0's map from a draft token's confidence at a depth to the probability that the target accepts it once
    its parent is: per (depth, confidence bin), the observed accepted/expected ratio, shrunk toward 1 by a prior at
    the draft's own word and interpolated between bins. Siblings are exclusive, so their prices sum to at most 1."""

    depths: int
    hits: list[list[float]] = field(init=False)  # [depth - 1][bin] accepted
    trials: list[list[float]] = field(init=False)
    conf: list[list[float]] = field(init=False)  # sum of the draft's confidence over the trials

    def __post_init__(self):
        self.hits, self.trials, self.conf = ([[0.0] * CALIBRATION_BINS for _ in range(self.depths)] for _ in range(3))

    def _depth(self, depth: int) -> int:
        return min(max(depth, 1), self.depths) - 1

    def _ratios(self, d: int) -> list[float]:
        """Per bin: (accepted + prior) / (expected + prior), the prior being CALIBRATION_PRIOR observations at the
        cell's mean confidence (the bin's centre while empty)."""
        out = []
        for b, (h, t, c) in enumerate(zip(self.hits[d], self.trials[d], self.conf[d])):
            prior = CALIBRATION_PRIOR * (c / t if t else (b + 0.5) / CALIBRATION_BINS)
            out.append((h + prior) / (c + prior))
        return out

    def _scaled(self, p: torch.Tensor, depth: int) -> torch.Tensor:
        """p times its cell's ratio, interpolated linearly between bin centres (so the price rises with p)."""
        ratios = torch.tensor(self._ratios(self._depth(depth)), dtype=torch.float64)
        x = (p * CALIBRATION_BINS - 0.5).clamp(0.0, CALIBRATION_BINS - 1.0)
        lo = x.floor().long()
        hi = (lo + 1).clamp(max=CALIBRATION_BINS - 1)
        frac = x - lo
        return (p * (ratios[lo] * (1 - frac) + ratios[hi] * frac)).clamp(CALIBRATION_FLOOR, 1.0)

    def prob(self, p: float, depth: int) -> float:
        """One token's calibrated price (no siblings)."""
        return float(self._scaled(torch.tensor(p, dtype=torch.float64), depth))

    def logp(self, logp: torch.Tensor, depth: int) -> torch.Tensor:
        """Calibrated log-probabilities for the draft's top-k log-probabilities `logp` [..., k] at `depth` (1: the
        root's children); the last dimension holds siblings."""
        q = self._scaled(logp.double().exp(), depth)
        q = q / q.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return q.log().to(logp.dtype)

    def fade(self) -> None:
        """Once a step: every cell's evidence weighs a little less, so a cell priced out of the tree (and so
        unobserved) drifts back to the draft's own word and is tried again."""
        for table in (self.hits, self.trials, self.conf):
            for row in table:
                for b in range(CALIBRATION_BINS):
                    row[b] *= CALIBRATION_FADE

    def observe(self, depth: int, p: float, accepted: bool) -> None:
        d, b = self._depth(depth), _bin(p)
        self.hits[d][b] += accepted
        self.trials[d][b] += 1.0
        self.conf[d][b] += p
        if self.trials[d][b] > CALIBRATION_WINDOW:
            scale = CALIBRATION_WINDOW / self.trials[d][b]
            for table in (self.hits, self.trials, self.conf):
                table[d][b] *= scale

    def summary(self) -> dict[int, dict[str, float]]:
        """By draft depth: recent verified candidates (older ones weigh less), their mean draft confidence and the
        fraction the target accepted."""
        out = {}
        for d in range(self.depths):
            n = sum(self.trials[d])
            if n:
                out[d + 1] = {
                    "observed": round(n, 1),
                    "confidence": round(sum(self.conf[d]) / n, 4),
                    "accepted": round(sum(self.hits[d]) / n, 4),
                }
        return out


@dataclass
class Estimates:
    """Rank 0's running figures: each kind of step's seconds besides its verify (by batch size), the drafting
    seconds, EAGLE tokens accepted per drafted sequence, the draft confidence's worth (`Calibration`), and each
    chain key's per-token acceptance: (CONTEXT, match length) or (CORPUS, support bucket or minus a match length)."""

    eagle_prior: float  # optimistic: every draft accepted, so drafting is tried until measured
    calibration: Calibration = field(default_factory=lambda: Calibration(1))
    # EAGLE tokens accepted per drafted sequence that verified a draft-only token (what a verified draft row earns,
    # as plan_step's guessed candidates price it), by whether a free chain was offered beside the draft. Beside one,
    # only draft tokens the chain did not also propose count: a shared token costs no extra row, and counting it
    # would have rank 0 draft beside chains where the draft adds little
    eagle_gain: dict[bool, float] = field(default_factory=dict)
    # (DRAFT | CONTEXT | PLAIN, batch): the last OVERHEAD_WINDOW measurements, whose median prices the kind
    overhead: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    draft_seconds: dict[int, float] = field(default_factory=dict)
    context_hits: dict[tuple[int, int], float] = field(default_factory=dict)
    context_trials: dict[tuple[int, int], float] = field(default_factory=dict)
    frozen: dict[str, float] | None = None  # overheads from a cost-table file: not measured
    steps: dict[int, int] = field(default_factory=dict)  # steps taken by batch size
    last_run: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, batch): its step number
    probe_after: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, batch): its probe interval
    observed_at: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, batch): step of its last figure

    def __post_init__(self):
        for chain in (False, True):
            self.eagle_gain.setdefault(chain, self.eagle_prior)

    def fixed(self, kind: str, batch: int) -> float:
        if self.frozen is not None:
            return self.frozen.get(kind, 0.0)
        return _nearest({b: statistics.median(v) for (k, b), v in self.overhead.items() if k == kind}, batch)

    def draft_time(self, batch: int) -> float:
        return _nearest(self.draft_seconds, batch)

    def context_p(self, key: tuple[int, int]) -> float:
        return (self.context_hits.get(key, 0.0) + 1.0) / (self.context_trials.get(key, 0.0) + 2.0)

    def observe_step(self, kind: str, batch: int, seconds: float) -> None:
        """A step's wall seconds besides its verify forward (as the cost table prices it)."""
        if self.frozen is None:
            now, key = self.steps.get(batch, 0), (kind, batch)
            recent = self.overhead.setdefault(key, [])
            if now - self.observed_at.get(key, now) > PROBE_AFTER:  # a probe: older figures are what it re-measures
                recent.clear()
            self.observed_at[key] = now
            recent.append(max(0.0, seconds))
            del recent[:-OVERHEAD_WINDOW]

    def observe_draft(self, batch: int, seconds: float, eagle_accepted: list[tuple[bool, int]]) -> None:
        """A drafting step: its draft seconds, and per sequence that verified a draft-only token, (whether a chain
        was offered beside it, the draft-only tokens accepted)."""
        _ema(self.draft_seconds, batch, seconds)
        for chain, a in eagle_accepted:
            self.eagle_gain[chain] += EMA * (a - self.eagle_gain[chain])

    def stale(self, batch: int) -> list[str]:
        """The speculative kinds not run at this batch size for their probe interval. A kind is measured only when
        chosen, so one priced out by a slow step (a page fault, a noisy neighbour) is run once more to be re-measured;
        its figures are not nudged toward optimistic, which would hold them far below the truth."""
        kinds = (DRAFT, CONTEXT_ONLY)
        if self.frozen is not None:  # a cost-table file's overheads are not measured; the EAGLE acceptance is, once
            # drafting has found it lower (beside a chain or without one: the probe drafts for both alike)
            kinds = (DRAFT,) if min(self.eagle_gain.values()) < self.eagle_prior else ()
        now = self.steps.get(batch, 0)
        return [
            k for k in kinds if now - self.last_run.get((k, batch), 0) >= self.probe_after.get((k, batch), PROBE_AFTER)
        ]

    def chose(self, kind: str, batch: int) -> None:
        """After rank 0 picks `kind`: advance the step clock. A kind run after its probe interval waits twice as long
        for the next probe (a wide batch's draft probe costs about two plain steps), one run sooner is back to
        PROBE_AFTER. The EAGLE acceptance is re-measured by the probes alone; it does not drift back to the prior."""
        now, key = self.steps.get(batch, 0), (kind, batch)
        if kind != PLAIN:
            wait = self.probe_after.get(key, PROBE_AFTER)
            self.probe_after[key] = min(2 * wait, PROBE_MAX) if now - self.last_run.get(key, 0) >= wait else PROBE_AFTER
        self.steps[batch] = self.last_run[key] = now + 1
        self.calibration.fade()

    def observe_context(self, key: tuple[int, int], offered: int, accepted: int) -> None:
        """A chain of `offered` tokens from `key`'s match, of which the first `accepted` were taken."""
        if offered:
            self.context_hits[key] = self.context_hits.get(key, 0.0) + accepted
            self.context_trials[key] = self.context_trials.get(key, 0.0) + accepted + (accepted < offered)


def _nearest(by_batch: dict[int, float], batch: int) -> float:
    """The figure measured at the nearest batch size; 0 (optimistic, so it gets tried and measured) before any."""
    return by_batch[min(by_batch, key=lambda b: (abs(b - batch), b))] if by_batch else 0.0


def _ema(table: dict, key, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else old + EMA * (value - old)


def chain_tokens(length: int, p: float) -> float:
    """A chain's expected accepted tokens, each token accepted with `p` once its predecessor is (as
    `context_candidates` prices them)."""
    return sum(p ** (i + 1) for i in range(length))


def context_candidates(seq: int, length: int, p: float) -> list[Candidate]:
    return [Candidate(p ** (i + 1), seq, CONTEXT, i) for i in range(length)]


def plan_step(
    est: Estimates, cost: CostTable, contexts: list[list[Candidate]], eagle_rows: int
) -> tuple[str, list[int]]:
    """Before drafting, the kind of step with the best expected tokens per second: DRAFT (EAGLE plus context
    candidates, sized after drafting), CONTEXT_ONLY (the returned number of context tokens per sequence), or a
    PLAIN decode step; or a speculative kind passed over for its probe interval, to measure it again
    (`Estimates.stale`)."""
    batch = len(contexts)
    ctx = [c for cs in contexts for c in cs]
    chosen, with_context = choose(ctx, batch, cost, est.fixed(CONTEXT_ONLY, batch))
    plain = batch / (est.fixed(PLAIN, batch) + cost.verify(batch))
    # each sequence's draft rows (none where the tree has no draft level), priced beside its chain or without one
    guessed = [
        Candidate(min(1.0, est.eagle_gain[bool(cs)] / eagle_rows), b, EAGLE, i)
        for b, cs in enumerate(contexts)
        for i in range(eagle_rows)
    ]
    _, with_draft = choose(ctx + guessed, batch, cost, est.fixed(DRAFT, batch))
    stale = est.stale(batch)
    if with_draft > max(with_context, plain) or DRAFT in stale:
        return DRAFT, [len(cs) for cs in contexts]
    if chosen and (with_context > plain or CONTEXT_ONLY in stale):
        return CONTEXT_ONLY, [sum(1 for c in chosen if c.seq == b) for b in range(batch)]
    return PLAIN, [0] * batch


def cap_eagle(cands: list[Candidate], cap: int) -> list[Candidate]:
    """At most `cap` EAGLE candidates per sequence (the likeliest); context candidates pass."""
    out = [c for c in cands if c.source != EAGLE]
    for b in {c.seq for c in cands}:
        mine = sorted((c for c in cands if c.source == EAGLE and c.seq == b), key=lambda c: (-c.prob, c.index))
        out += mine[:cap]
    return out


def worth_expanding(
    cands: list[Candidate],
    frontier: list[tuple[int, float]],
    k: int,
    cap: int,
    batch: int,
    cost: CostTable,
    spent_s: float,
    step_s: float,
) -> bool:
    """Another draft level adds at most k children under each frontier node (seq, prob), none likelier than its
    parent: expand only when even that best case beats verifying what is drafted now."""
    _, now = choose(cap_eagle(cands, cap), batch, cost, spent_s)
    bound = [Candidate(p, b, EAGLE, 1 << 30) for b, p in frontier for _ in range(k)]
    _, deeper = choose(cap_eagle(cands + bound, cap), batch, cost, spent_s + step_s)
    return deeper > now
