"""Every Prometheus metric eaglegate exports, in one place (`eaglegate_` prefix, label model_name).

Workers put per-step figures into each StepReport; the front end turns them into metrics here, so a step
never waits on metrics.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
SYNC_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
ACCEPT_BUCKETS = tuple(float(i) for i in range(1, 17))
REQUEST_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 16.0)
SPEC_WINDOW_S = 10.0  # SGLang-style speculation gauges average over this much recent time


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, spec_positions: int = 0):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["model_name"]

        def hist(name, doc, buckets, extra=()):
            return Histogram(f"eaglegate_{name}", doc, lbl + list(extra), buckets=buckets, registry=r)

        def counter(name, doc, extra=()):
            return Counter(f"eaglegate_{name}", doc, lbl + list(extra), registry=r)

        def gauge(name, doc):
            return Gauge(f"eaglegate_{name}", doc, lbl, registry=r)

        # speculative decoding
        self.spec_accept_length = hist(
            "spec_accept_length",
            "Tokens committed per verify step and request (accepted drafts plus the bonus token).",
            ACCEPT_BUCKETS,
        )
        self.spec_accepted_per_position = counter(
            "spec_accepted_tokens_per_position", "Draft tokens accepted at each tree depth.", ["position"]
        )
        self.spec_draft_tokens = counter("spec_draft_tokens", "Draft tokens proposed for verification.")
        self.spec_accepted_tokens = counter("spec_accepted_tokens", "Draft tokens accepted by the target.")
        self.spec_verify_steps = counter("spec_verify_steps", "Verify steps (one per request and step).")
        self.spec_source_draft = counter(
            "spec_source_draft_tokens",
            "Candidates verified, by source (eagle: the draft head; context: prompt "
            "lookup; a candidate both proposed counts for both).",
            ["source"],
        )
        self.spec_source_accepted = counter(
            "spec_source_accepted_tokens", "Candidates accepted, by source.", ["source"]
        )
        self.spec_steps = counter(
            "spec_steps",
            "Decode steps of speculating requests by the kind rank 0's budget "
            "chose: draft (EAGLE and context), context (context candidates only), plain.",
            ["kind"],
        )
        # the same figures under vLLM's names (deploy/prometheus/recording_rules.yml yields the vllm: series)
        self.vllm_num_drafts = counter(
            "spec_decode_num_drafts", "Sequence-steps that verified draft candidates (vLLM's num_drafts)."
        )
        self.vllm_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified (vLLM's name).")
        self.vllm_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted (vLLM's name)."
        )
        self.vllm_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position, 0-based as vLLM counts (position 0: the first draft token).",
            ["position"],
        )
        # SGLang's gauges: over the last SPEC_WINDOW_S seconds of verify steps (0 when none)
        self._window: deque[tuple[float, int, int, int]] = deque()  # (time, verify steps, accepted, drafted)
        self._window_lock = threading.Lock()
        self.accept_length_recent = gauge(
            "spec_accept_length_mean",
            f"Tokens committed per verify step over the last {SPEC_WINDOW_S:.0f} s (SGLang's spec_accept_length).",
        )
        self.accept_rate_recent = gauge(
            "spec_accept_rate",
            f"Accepted over verified draft tokens, last {SPEC_WINDOW_S:.0f} s (SGLang's spec_accept_rate).",
        )
        self.labels(self.accept_length_recent).set_function(
            lambda: self._recent(lambda v, a, d: (v + a) / v if v else 0)
        )
        self.labels(self.accept_rate_recent).set_function(lambda: self._recent(lambda v, a, d: a / d if d else 0))
        self.request_accept_length = hist(
            "request_spec_accept_length",
            "Each finished speculating request's mean tokens per verify step: an output-quality alarm per request.",
            REQUEST_ACCEPT_BUCKETS,
        )
        self.rejected = counter(
            "requests_rejected",
            "Requests refused before reaching rank 0, by status: 429 (request or token limits), 503 (draining, "
            "engine down or restarting, rank 0's inbox full).",
            ["status"],
        )
        # cross-rank decision sync
        self.decision_sync = hist(
            "decision_sync_latency_seconds",
            "Latency of rank 0's decision broadcasts: kind=verify for the packed verify "
            "decision, kind=draft for draft candidates, kind=control for the per-step plan.",
            SYNC_BUCKETS,
            ["kind"],
        )
        self.consistency_checks = counter("rank_consistency_checks", "Cross-rank state fingerprint comparisons.")
        self.divergences = counter("rank_divergences", "Cross-rank state mismatches detected by the guard.")
        # requests
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first output token.", LATENCY_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between successive output chunks, per token.", LATENCY_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last output token.", LATENCY_BUCKETS)
        self.queue_time = hist("queue_time_seconds", "Time from arrival to first scheduling.", LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.requests = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        # engine
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.kv_usage = gauge("kv_cache_usage_ratio", "Fraction of KV cache slots in use (0..1).")
        self.steps = counter("engine_steps", "Engine steps executed by rank 0.")
        # prefix cache (rank 0's radix tree)
        self.cache_queried = counter("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache (not prefilled)")
        self.cache_evicted = counter("prefix_cache_evicted_tokens", "Tokens evicted from the prefix cache.")
        self.cache_size = gauge("prefix_cache_tokens", "Tokens held by the prefix cache (in use or evictable).")
        self._totals: dict[str, int] = {}
        # create every series up front so dashboards show zeros, not gaps, before the first event
        for metric in (
            self.spec_accept_length,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
            self.spec_verify_steps,
            self.consistency_checks,
            self.divergences,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.prompt_tokens,
            self.generation_tokens,
            self.running,
            self.waiting,
            self.kv_usage,
            self.steps,
            self.cache_queried,
            self.cache_hits,
            self.cache_evicted,
            self.cache_size,
        ):
            self.labels(metric)
        for kind in ("control", "draft", "verify"):
            self.labels(self.decision_sync, kind=kind)
        for source in ("eagle", "context"):
            self.labels(self.spec_source_draft, source=source)
            self.labels(self.spec_source_accepted, source=source)
        for kind in ("draft", "context", "plain"):
            self.labels(self.spec_steps, kind=kind)
        for pos in range(1, spec_positions + 1):
            self.labels(self.spec_accepted_per_position, position=str(pos))
        for reason in ("stop", "length", "abort"):
            self.labels(self.requests, finished_reason=reason)
        for metric in (self.vllm_num_drafts, self.vllm_num_draft_tokens, self.vllm_num_accepted_tokens):
            self.labels(metric)
        self.labels(self.request_accept_length)
        for pos in range(spec_positions):
            self.labels(self.vllm_accepted_per_pos, position=str(pos))
        for status in ("429", "503"):
            self.labels(self.rejected, status=status)

    def labels(self, metric, **extra):
        return metric.labels(model_name=self.model_name, **extra)

    def on_step(self, report) -> None:
        """Called from the engine's receiver thread for every StepReport."""
        s = report.stats
        if s is not None:  # rank 0 sends one at most every SNAPSHOT_INTERVAL_S, and with every finished request
            self.labels(self.running).set(s.running)
            self.labels(self.waiting).set(s.waiting)
            self.labels(self.kv_usage).set(s.kv_used_tokens / (s.kv_total_tokens or 1))
            self._count("steps", self.steps, s.steps)
            pc = s.prefix_cache
            if pc is not None:
                self._count("cache_queried", self.cache_queried, pc.prompt_tokens)
                self._count("cache_hits", self.cache_hits, pc.hit_tokens)
                self._count("cache_evicted", self.cache_evicted, pc.evicted_tokens)
                self.labels(self.cache_size).set(pc.cached_tokens)
        m = report.step_metrics
        for kind, seconds in m.sync_seconds.items():
            sync = self.labels(self.decision_sync, kind=kind)
            for x in seconds:
                sync.observe(x)
        if m.consistency_checks:
            self.labels(self.consistency_checks).inc(m.consistency_checks)
        for length in m.accept_lengths:
            self.labels(self.spec_accept_length).observe(length)
        c = m.spec
        if c.verify_steps:
            self.labels(self.spec_verify_steps).inc(c.verify_steps)
            self.labels(self.spec_draft_tokens).inc(c.draft_tokens)
            self.labels(self.spec_accepted_tokens).inc(c.accepted_tokens)
            self.labels(self.vllm_num_drafts).inc(c.verify_steps)
            self.labels(self.vllm_num_draft_tokens).inc(c.draft_tokens)
            self.labels(self.vllm_num_accepted_tokens).inc(c.accepted_tokens)
            with self._window_lock:
                now = time.monotonic()
                self._window.append((now, c.verify_steps, c.accepted_tokens, c.draft_tokens))
                while self._window[0][0] < now - SPEC_WINDOW_S:  # bounded whether or not anyone scrapes
                    self._window.popleft()
            for source, drafted, accepted in (
                ("eagle", c.eagle_tokens, c.eagle_accepted_tokens),
                ("context", c.context_tokens, c.context_accepted_tokens),
                ("corpus", c.corpus_tokens, c.corpus_accepted_tokens),
            ):
                self.labels(self.spec_source_draft, source=source).inc(drafted)
                self.labels(self.spec_source_accepted, source=source).inc(accepted)
            for pos, count in enumerate(m.accepted_per_position):
                if count:
                    self.labels(self.spec_accepted_per_position, position=str(pos + 1)).inc(count)
                    self.labels(self.vllm_accepted_per_pos, position=str(pos)).inc(count)
        for kind, count in m.spec_steps.items():
            self.labels(self.spec_steps, kind=kind).inc(count)

    def _recent(self, ratio) -> float:
        """ratio(verify steps, accepted, drafted) over the window's steps, dropping older ones."""
        cutoff = time.monotonic() - SPEC_WINDOW_S
        with self._window_lock:
            while self._window and self._window[0][0] < cutoff:
                self._window.popleft()
            sums = [sum(x[i] for x in self._window) for i in (1, 2, 3)]
        return float(ratio(*sums))

    def _count(self, key: str, metric, total: int) -> None:
        """Counters from rank 0's running totals; a restarted engine counts from zero again."""
        last = self._totals.get(key, 0)
        if total < last:
            last = 0
        if total > last:
            self.labels(metric).inc(total - last)
        self._totals[key] = total

    def on_fatal(self, fatal) -> None:
        if fatal.kind == "RankDivergenceError":
            self.labels(self.divergences).inc()
