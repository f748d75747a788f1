"""Typed figures rank 0 sends with every report: a snapshot of the engine's state, and what happened since the last
report. The front end turns them into `/engine/stats` and Prometheus metrics; no package matches keys by string."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecCounts:
    """Speculative decoding counters: totals in a snapshot, increments in StepMetrics."""

    verify_steps: int = 0  # sequence-steps verified
    drafted_steps: int = 0  # of those, with an EAGLE draft (the rest verified context candidates only)
    draft_tokens: int = 0  # candidate tokens verified, all sources
    accepted_tokens: int = 0
    eagle_tokens: int = 0  # candidates proposed by the draft head (a token proposed by both counts in both)
    eagle_accepted_tokens: int = 0
    context_tokens: int = 0  # candidates proposed by prompt lookup
    context_accepted_tokens: int = 0
    corpus_tokens: int = 0  # candidates proposed by the corpus of the target's answers (speculative/corpus.py)
    corpus_accepted_tokens: int = 0

    def add(self, other: SpecCounts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def accept_length_mean(self) -> float:
        """τ: tokens committed per verify step, the bonus token included."""
        return (self.verify_steps + self.accepted_tokens) / self.verify_steps if self.verify_steps else 0.0


@dataclass
class PrefixCacheCounts:
    """The radix cache's totals (prefix_cache.py)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of those, found in the cache (not prefilled)
    cached_tokens: int = 0  # tokens the tree holds now (block-granular)
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class EngineSnapshot:
    """The engine's state after a step."""

    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    num_preemptions: int = 0
    steps: int = 0
    time: float = 0.0
    spec: SpecCounts | None = None  # None without speculation
    # rank 0's verify cost: {rows: ms} from a file, or by context and batch size ({rows per sequence: ms}) measured
    spec_verify_cost_ms: dict | None = None
    spec_draft_calibration: dict[int, dict[str, float]] | None = None  # by draft depth (budget.Calibration.summary)
    spec_disable_batch_size: int | None = None  # decode batches this large step plainly (0: none; rank 0's limit)
    prefix_cache: PrefixCacheCounts | None = None  # None with --disable-radix-cache
    graph_replays: int = 0  # target forwards run from captured graphs (worker/kernels/cuda_graph.py)

    def as_dict(self) -> dict:
        """The flat JSON of `/engine/stats` (speculative counters prefixed `spec_`)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.startswith(("spec", "prefix_cache"))
        }
        if self.prefix_cache is not None:
            out |= {f"prefix_cache_{k}": v for k, v in dataclasses.asdict(self.prefix_cache).items()}
            out["prefix_cache_hit_rate"] = self.prefix_cache.hit_rate
        if self.spec is not None:
            out |= {f"spec_{k}": v for k, v in dataclasses.asdict(self.spec).items()}
            out["spec_accept_length_mean"] = self.spec.accept_length_mean
        if self.spec_verify_cost_ms is not None:
            out["spec_verify_cost_ms"] = self.spec_verify_cost_ms
        if self.spec_draft_calibration is not None:
            out["spec_draft_calibration"] = self.spec_draft_calibration
        if self.spec_disable_batch_size is not None:
            out["spec_disable_batch_size"] = self.spec_disable_batch_size
        return out


@dataclass
class StepMetrics:
    """What happened since the last report, for histograms and counters."""

    sync_seconds: dict[str, list[float]] = field(default_factory=dict)  # collective kind ("control", "draft", ...)
    consistency_checks: int = 0
    spec: SpecCounts = field(default_factory=SpecCounts)
    accept_lengths: list[int] = field(default_factory=list)  # one per verified sequence-step, bonus included
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at depth i + 1
    spec_steps: dict[str, int] = field(default_factory=dict)  # by kind: "draft", "context", "plain"
    phase_seconds: dict[str, list[float]] = field(default_factory=dict)  # speculative phases ("draft", "verify")

    def add_sync(self, kind: str, seconds: float) -> None:
        self.sync_seconds.setdefault(kind, []).append(seconds)

    def is_empty(self) -> bool:
        return self == StepMetrics()
