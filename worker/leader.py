"""Rank 0: takes requests, schedules, broadcasts each step's plan, samples, and reports to the front end."""

from __future__ import annotations

import functools
import time

import torch

from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.guard import check_consistency, fingerprint
from worker.model.tokenizer import load_tokenizer
from worker.prefix_cache import PrefixCache
from worker.protocol import (
    ERROR_CONTEXT_LENGTH,
    ERROR_ENGINE,
    ERROR_INVALID_GRAMMAR,
    FINISH_DEAD_END,
    FINISH_TIMEOUT,
    AbortRequest,
    AddRequest,
    AddRequests,
    ForwardPlan,
    RequestOutput,
    StepPlan,
    StepReport,
)
from worker.runner import ModelRunner
from worker.sampling.grammar import matcher
from worker.sampling.grammar_process import CompileResult, GrammarCompiler
from worker.sampling.logits import filter_probs, prepare_logits, sample_from_probs, top_logprobs
from worker.scheduler import BlockPool, ScheduledSeq, Scheduler, Sequence
from worker.stats import EngineSnapshot, StepMetrics

# a report carries rank 0's stats snapshot at most this often while steps run (and always with a finished request or
# outside a step), in seconds: building, pickling and sending it every step costs 2.5% of plain decode's speed on CPU
SNAPSHOT_INTERVAL_S = 0.05
EXPIRY_INTERVAL_S = 0.1  # how often rank 0 looks for requests past their timeout


class Leader:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tp: TPGroup):
        self.config, self.runner, self.tp = config, runner, tp
        self.model_cfg = runner.model_cfg
        pool = BlockPool(runner.num_blocks, config.block_size)
        self.max_model_len = min(
            config.max_model_len or self.model_cfg.max_position_embeddings,
            runner.model.rope.cos.shape[0] - self.reserve,  # speculative trees reach `reserve` positions ahead
            pool.num_blocks * pool.block_size - self.reserve,
        )
        cache = None if config.disable_radix_cache else PrefixCache(config.block_size)
        self.scheduler = Scheduler(
            pool, config.max_running_requests, config.chunked_prefill_size, self.max_model_len, cache
        )
        self.rng = torch.Generator()
        self.rng.manual_seed(config.seed)
        self.step_no = 0
        self.next_seq_id = 0
        self.outputs: list[RequestOutput] = []
        self.step_metrics = StepMetrics()
        self.snapshot_sent = float("-inf")  # time.monotonic() of the last report that carried a snapshot
        self.eos_ids = tuple(self.model_cfg.eos_token_ids)
        self.grammars = GrammarCompiler(
            functools.partial(load_tokenizer, runner.source, config.tokenizer_path),
            self.model_cfg.vocab_size,
            self.eos_ids,
            config.grammar_compile_timeout,
        )
        self.compiling: dict[str, tuple[AddRequest, torch.Generator]] = {}  # requests whose grammar compiles
        self.expiry_checked = float("-inf")

    @property
    def reserve(self) -> int:
        """Extra KV slots a decoding sequence needs per step (speculation overrides this)."""
        return 0

    # --- requests -------------------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, AddRequests):
            for req in msg.requests:
                self._add(req)
        elif isinstance(msg, AbortRequest):
            seq = self.scheduler.by_request.get(msg.request_id)
            if seq is not None:
                self.scheduler.finish(seq, "abort")
                self._report(seq)
            elif msg.request_id in self.compiling:
                req, _ = self.compiling.pop(msg.request_id)
                self.grammars.cancel(msg.request_id)
                self.outputs.append(RequestOutput(req.request_id, [], None, "abort", len(req.prompt_ids), 0))

    def _add(self, req: AddRequest) -> None:
        n = len(req.prompt_ids)
        if n == 0 or n >= self.max_model_len:
            self.outputs.append(
                RequestOutput(
                    req.request_id,
                    [],
                    None,
                    "error",
                    n,
                    0,
                    error=f"prompt has {n} tokens; it must have between 1 and "
                    f"{self.max_model_len - 1} (the context limit)",
                    error_code=ERROR_CONTEXT_LENGTH,
                )
            )
            return
        gen = torch.Generator(device=self.tp.device)
        seed = (
            req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.rng))
        )
        gen.manual_seed(seed)
        if req.params.grammar is None:
            self._enqueue(req, gen, None)
            return
        cached = self.grammars.submit(req.request_id, req.params.grammar)
        if cached is not None:
            self._compiled(cached, req, gen)
        else:
            self.compiling[req.request_id] = (req, gen)

    def _enqueue(self, req: AddRequest, gen: torch.Generator, grammar) -> None:
        seq = Sequence(self.next_seq_id, req.request_id, list(req.prompt_ids), len(req.prompt_ids), req.params, gen)
        seq.grammar = grammar
        self.next_seq_id += 1
        self.scheduler.add(seq)

    def _compiled(self, result: CompileResult, req: AddRequest, gen: torch.Generator) -> None:
        if result.compiled is not None:
            self._enqueue(req, gen, matcher(result.compiled, self.model_cfg.vocab_size))
            return
        self.outputs.append(
            RequestOutput(
                req.request_id,
                [],
                None,
                "error",
                len(req.prompt_ids),
                0,
                error=f"the grammar cannot be compiled: {result.error}",
                error_code=ERROR_INVALID_GRAMMAR,
            )
        )

    def admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler (or fail with the compiler's reason); the
        step loop calls this between steps and never waits on a compile."""
        if not self.grammars.busy:
            return
        for result in self.grammars.poll():
            entry = self.compiling.pop(result.request_id, None)
            if entry is not None:
                self._compiled(result, *entry)

    def waiting_on_grammars(self) -> bool:
        return bool(self.compiling)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def expire(self) -> None:
        """Finish the requests past their timeout (rank 0's clock, a decision the plans carry to every rank): their
        KV returns to the pool and the client gets finish_reason "timeout" with what was generated."""
        now = time.monotonic()
        if now - self.expiry_checked < EXPIRY_INTERVAL_S:
            return
        self.expiry_checked = now
        for seq in list(self.scheduler.by_request.values()):
            limit = seq.params.timeout_s
            if limit is not None and now - seq.arrival > limit:
                self.scheduler.finish(seq, FINISH_TIMEOUT)
                self._report(seq)

    # --- one step -----------------------------------------------------------------------------------
    def build_plan(self, batch: list[ScheduledSeq]) -> ForwardPlan:
        ids: list[int] = []
        seqs, rows = [], []
        for item in batch:
            s = item.seq
            ids.extend(s.token_ids[s.num_cached : s.num_cached + item.num_tokens])
            seqs.append((s.num_cached, item.num_tokens, list(s.block_table)))
            if item.samples:
                rows.append(len(ids) - 1)
        return ForwardPlan(self.step_no, ids, seqs, rows)

    def step(self) -> None:
        batch = self.scheduler.schedule(self.reserve)
        if batch:
            self.plain_step(batch)

    def plain_step(self, batch: list[ScheduledSeq]) -> None:
        """One target forward over the batch; every sequence that reached its end samples one token."""
        self.step_no += 1
        plan = self.build_plan(batch)
        self.broadcast_plan(plan, [item.seq for item in batch])
        logits, _, _ = self.runner.forward(plan)
        sampled = [item for item in batch if item.samples]
        for item in batch:
            item.seq.num_cached += item.num_tokens
            if item.num_tokens > 1:
                self.scheduler.cache_progress(item.seq)
        for row, item in enumerate(sampled):
            self._sample_and_append(item.seq, logits[row])
        self.check(plan, committed_lengths(plan))

    def broadcast_plan(self, plan: StepPlan, seqs: list[Sequence]) -> None:
        """The per-step control broadcast: followers run exactly what rank 0 decided. Each sequence of the step
        is charged the wait (its trace's decision-sync time)."""
        if self.tp.size == 1:
            return
        t0 = time.perf_counter()
        self.tp.broadcast_object(plan)
        waited = time.perf_counter() - t0
        self.step_metrics.add_sync("control", waited)
        for seq in seqs:
            seq.sync_seconds += waited

    def check(self, plan: StepPlan, committed: list[int]) -> None:
        if maybe_check(self.config, self.tp, plan, committed):
            self.step_metrics.consistency_checks += 1

    def _sample_and_append(self, seq: Sequence, logits: torch.Tensor) -> None:
        p = seq.params
        raw = logits
        logits = prepare_logits(seq, logits)
        if seq.grammar is not None and not torch.isfinite(logits).any():
            self._finish(seq, FINISH_DEAD_END)
            return
        if p.greedy:
            token = int(torch.argmax(logits))
        else:
            token = sample_from_probs(filter_probs(logits, p), seq.generator)
        self.append_tokens(seq, [token], [raw] if p.logprobs is not None else None)

    def append_tokens(self, seq: Sequence, tokens: list[int], logits_rows: list[torch.Tensor] | None) -> None:
        """Append tokens in order, stopping at the first that finishes the sequence; report either way."""
        for i, tok in enumerate(tokens):
            if seq.grammar is not None and not seq.grammar.accept(tok):  # only where no token was allowed
                self.scheduler.finish(seq, FINISH_DEAD_END)
                break
            seq.token_ids.append(tok)
            seq.pending_tokens.append(tok)
            if logits_rows is not None:
                seq.pending_logprobs.append(top_logprobs(logits_rows[i], tok, seq.params.logprobs or 0))
            if self.scheduler.check_finished(seq, self.eos_ids):
                self.scheduler.finish(seq)
                break
        self._report(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._report(seq)

    def _report(self, seq: Sequence) -> None:
        queued = None
        if not seq.reported and seq.first_scheduled is not None:
            queued = seq.first_scheduled - seq.arrival
            seq.reported = True
        self.outputs.append(
            RequestOutput(
                seq.request_id,
                seq.pending_tokens,
                seq.pending_logprobs if seq.params.logprobs is not None else None,
                seq.finish_reason,
                seq.num_prompt,
                len(seq.output_ids),
                queue_seconds=queued,
                cached_tokens=seq.num_hit_tokens,
                spec=seq.spec if seq.finish_reason is not None else None,
                sync_seconds=seq.sync_seconds if seq.finish_reason is not None else None,
            )
        )
        seq.pending_tokens, seq.pending_logprobs = [], []

    def take_report(self, stepped: bool = False) -> StepReport | None:
        """The outputs and step metrics since the last report, with the stats snapshot where it is due (see
        SNAPSHOT_INTERVAL_S); None when there is nothing new to say."""
        if not self.outputs and self.step_metrics.is_empty() and not stepped:
            return None
        now = time.monotonic()
        fresh = (
            not stepped
            or now - self.snapshot_sent >= SNAPSHOT_INTERVAL_S
            or any(out.finish_reason is not None for out in self.outputs)
        )
        if fresh:
            self.snapshot_sent = now
        report = StepReport(self.outputs, self.snapshot() if fresh else None, self.step_metrics)
        self.outputs, self.step_metrics = [], StepMetrics()
        return report

    def snapshot(self) -> EngineSnapshot:
        graphs = self.runner.graphs
        return self.scheduler.snapshot(
            steps=self.step_no, time=time.time(), graph_replays=graphs.replays if graphs is not None else 0
        )

    def fail_all(self, message: str) -> None:
        for req, _ in self.compiling.values():
            self.outputs.append(
                RequestOutput(
                    req.request_id, [], None, "error", len(req.prompt_ids), 0, error=message, error_code=ERROR_ENGINE
                )
            )
        self.compiling.clear()
        self.grammars.close()
        for seq in list(self.scheduler.by_request.values()):
            self.scheduler.finish(seq, "error")
            self.outputs.append(
                RequestOutput(
                    seq.request_id,
                    [],
                    None,
                    "error",
                    seq.num_prompt,
                    len(seq.output_ids),
                    error=message,
                    error_code=ERROR_ENGINE,
                )
            )


def follower_step(config: EngineConfig, runner: ModelRunner, tp: TPGroup, plan: ForwardPlan) -> None:
    """A non-zero rank's share of a plain step: the same forward (its collectives pair with rank 0's)."""
    runner.forward(plan)
    maybe_check(config, tp, plan, committed_lengths(plan))


def committed_lengths(plan: ForwardPlan) -> list[int]:
    """Token count of each sequence after the step: cached tokens, plus one if the step sampled for it."""
    sampled_ends = set(plan.sample_rows)
    out, end = [], -1
    for ctx, q, _ in plan.seqs:
        end += q
        out.append(ctx + q + (1 if end in sampled_ends else 0))
    return out


def maybe_check(config: EngineConfig, tp: TPGroup, plan: StepPlan, committed: list[int]) -> bool:
    """Run the divergence guard on the steps its interval selects; True when it ran (and passed)."""
    interval = config.rank_consistency_check_interval
    digest = fingerprint(plan, committed)
    if tp.recorder is not None:  # worker/forensics.py: the flight recorder and the heartbeat
        tp.recorder.record(plan, committed, digest)
    if tp.heartbeat is not None:
        tp.heartbeat.step_done(plan.step, digest)
    if tp.size > 1 and interval and plan.step % interval == 0:
        check_consistency(tp, plan.step, digest)
        return True
    return False
