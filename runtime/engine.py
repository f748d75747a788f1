"""The front-end side of the engine: starts and supervises the TP worker processes, sends them requests
over pyzmq, and routes their outputs to per-request queues (sync or asyncio)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import zmq

from worker.config import EngineConfig
from worker.dist import free_port
from worker.forensics import read_heartbeats
from worker.model.config import load_model_config
from worker.model.files import forget_gguf, resolve_model
from worker.model.loader import check_tp_divisibility
from worker.model.tokenizer import load_tokenizer
from worker.protocol import AbortRequest, AddRequest, AddRequests, Fatal, Ready, RequestOutput, Shutdown, StepReport
from worker.sampling.params import InvalidParameterError, SamplingParams, TokenLogprobs
from worker.stats import EngineSnapshot

from .rank_main import run_rank
from .rank_start import rank_context

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The worker group failed (a rank died, diverged or timed out); the engine serves nothing more."""


class RequestFailedError(RuntimeError):
    pass


class EngineBusyError(RuntimeError):
    """Admission control: requests or prompt tokens in flight are at their limit (a 429 to clients)."""


SEND_WAIT_MS = 100  # how long a submit may wait for room in rank 0's inbox before it is refused
DUMP_GRACE_S = 1.0  # with --crash-dump-folder: how long ranks still alive in a failed group get to write their dumps


class EngineInboxFullError(RuntimeError):
    """Rank 0 has not taken its messages for so long that its inbox is full (a 503 to clients): a send never waits."""


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class _Sink:
    """Where one request's outputs go: a thread-safe queue, or an asyncio queue fed from our thread."""

    put: Callable[[object], None]
    prompt_tokens: int = 0


@dataclass
class EngineStats:
    """What the front end knows of the engine: rank 0's latest snapshot and the divergences it was told of."""

    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)
    rank_divergences: int = 0
    cpu_kernel: str = ""  # from the Ready message: what multiplies quantized weights on CPU
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def values(self) -> dict:
        """The flat JSON of `/engine/stats`."""
        return self.snapshot.as_dict() | {"rank_divergences": self.rank_divergences, "cpu_kernel": self.cpu_kernel}


class AsyncRequest:
    """One in-flight request seen from an asyncio loop. cancel() aborts it on every rank unless finished."""

    def __init__(self, engine: Engine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sink = _Sink(lambda item: loop.call_soon_threadsafe(self.queue.put_nowait, item))
        self.finished = False

    async def next(self) -> RequestOutput:
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._forget(self.request_id)
            self.engine.abort(self.request_id)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        on_step: Callable[[StepReport], None] | None = None,
        on_fatal: Callable[[Fatal], None] | None = None,
    ):
        config.validate()
        self.config = config
        self.source = resolve_model(config.model_path)
        self.model_cfg = load_model_config(self.source)
        forget_gguf()  # the front end needs the config alone, not the file's mapping
        check_tp_divisibility(self.model_cfg, config.tp_size)
        self.on_step, self.on_fatal = on_step, on_fatal
        self.observer_errors = 0  # observer (on_step/on_fatal) calls that raised
        self._sinks: dict[str, _Sink] = {}
        self._prompt_tokens = 0  # of the requests in _sinks
        self.final_heartbeats: list[dict | None] | None = None  # the ranks' last heartbeats when the group died
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._dead_event = threading.Event()
        self._closing = False
        self.stats = EngineStats()
        self._ipc_dir = tempfile.mkdtemp(prefix="eaglegate-")
        self._zctx = zmq.Context()
        self._to_leader = self._zctx.socket(zmq.PUSH)
        self._to_leader.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = f"ipc://{self._ipc_dir}/in", f"ipc://{self._ipc_dir}/out"
        self._to_leader.bind(in_addr)
        self._from_leader = self._zctx.socket(zmq.PULL)
        self._from_leader.bind(out_addr)
        self._procs = self._start_workers(in_addr, out_addr)
        t0 = time.monotonic()
        try:
            self.tokenizer = load_tokenizer(self.source, config.tokenizer_path)  # while the ranks load
            self.ready = self._wait_ready()
        except BaseException:  # a failed start leaks nothing: no rank, no socket, no zmq context, no ipc folder
            self._closing = True  # (no flight records: nothing was served)
            self._kill_workers()
            self._to_leader.close()
            self._from_leader.close()
            self._zctx.term()
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            raise
        self.load_seconds = time.monotonic() - t0
        self.stats.snapshot = EngineSnapshot(kv_total_tokens=self.ready.kv_total_tokens)
        self.stats.cpu_kernel = self.ready.cpu_kernel
        self._receiver = threading.Thread(target=self._receive_loop, name="eaglegate-receiver", daemon=True)
        self._receiver.start()
        self._monitor = threading.Thread(target=self._monitor_loop, name="eaglegate-monitor", daemon=True)
        self._monitor.start()

    # --- worker processes ------------------------------------------------------------------------------
    def _start_workers(self, in_addr: str, out_addr: str) -> list[mp.Process]:
        cfg = self.config
        addr = cfg.dist_init_addr or f"127.0.0.1:{free_port()}"
        init_method = f"tcp://{addr}"
        ctx = rank_context(cfg.device)
        procs = []
        local = cfg.local_tp_size
        for local_rank in range(local):
            rank = cfg.node_rank * local + local_rank
            p = ctx.Process(
                target=run_rank,
                args=(cfg, rank, local_rank, init_method, in_addr, out_addr, dict(os.environ)),
                name=f"eaglegate-tp{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        return procs

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def _wait_ready(self) -> Ready:
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline:
            if self._from_leader.poll(200):
                msg = self._from_leader.recv_pyobj()
                if isinstance(msg, Ready):
                    # zmq connects asynchronously: until rank 0's inbox is attached a send that must not wait
                    # (NOBLOCK) would fail as if the inbox were full, so start serving once it can be sent to
                    if self._to_leader.poll(max(1, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
                        return msg
                    break
                if isinstance(msg, Fatal):
                    self._kill_workers()
                    raise EngineDeadError(f"engine failed to start: {msg.message}")
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                # rank 0's Fatal report, sent just before it exited, says more than an exit code
                reason = f"worker {dead[0].name} exited with code {dead[0].exitcode}"
                while self._from_leader.poll(1000):
                    msg = self._from_leader.recv_pyobj()
                    if isinstance(msg, Fatal):
                        reason = msg.message
                        break
                self._kill_workers()
                raise EngineDeadError(f"engine failed to start: {reason}")
        self._kill_workers()
        raise EngineDeadError(f"engine did not become ready within {self.config.startup_timeout:.0f} s")

    def _kill_workers(self) -> None:
        alive = [p for p in self._procs if p.is_alive()]
        if alive and self.config.crash_dump_folder and not self._closing:
            for p in alive:  # ranks stuck in a collective write their flight record first (worker/forensics.py)
                os.kill(p.pid, signal.SIGUSR1)
            deadline = time.monotonic() + DUMP_GRACE_S
            while any(p.is_alive() for p in alive) and time.monotonic() < deadline:
                time.sleep(0.05)
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)

    def _monitor_loop(self) -> None:
        sentinels = [p.sentinel for p in self._procs]
        wait_sentinels(sentinels)
        if self._closing:
            return
        # rank 0 reports why (a Fatal) just before it exits; wait for that report, briefly, since it says more
        # a dead follower breaks rank 0's next collective (its idle heartbeat runs every second), so rank 0 exits
        # soon too; wait for it, bounded, then give its report a moment to arrive
        deadline, rank0_gone_at = time.monotonic() + min(max(5.0, self.config.dist_timeout), 15.0), None
        while not self._dead_event.wait(0.05) and time.monotonic() < deadline:
            if self._procs[0].exitcode is not None and self.config.node_rank == 0:
                rank0_gone_at = rank0_gone_at or time.monotonic()
                if time.monotonic() - rank0_gone_at > 0.5:
                    break
        self._mark_dead("")

    def _death_note(self) -> str:
        dead = [p for p in self._procs if p.exitcode is not None]
        return "; ".join(f"worker {p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in dead)

    def rank_heartbeats(self) -> list[dict | None]:
        """Each of this node's ranks: its last step, when, its fingerprint and its collective (worker/forensics.py)."""
        return read_heartbeats(Path(self._ipc_dir), self.config.local_tp_size)

    def _mark_dead(self, reported: str) -> None:
        """Fail every pending request. A rank-0 report and the exit codes of dead workers make the reason."""
        if self.final_heartbeats is None:
            self.final_heartbeats = self.rank_heartbeats()  # what each rank last did, before its files go
        if not self._closing:
            # a dead follower makes rank 0 report a broken pipe; give the exit codes a moment to show
            deadline = time.monotonic() + 1.0
            while not self._death_note() and time.monotonic() < deadline:
                wait_sentinels([p.sentinel for p in self._procs], timeout=0.05)
        note = self._death_note()
        reason = "; ".join(x for x in (note, reported and f"rank 0 reported: {reported}") if x) or "engine stopped"
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            self._dead_event.set()
            sinks = list(self._sinks.items())
            self._sinks.clear()
            self._prompt_tokens = 0
        for _, sink in sinks:
            sink.put(EngineDeadError(reason))
        if not self._closing:
            self._kill_workers()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def wait_dead(self, timeout: float | None = None) -> bool:
        """Block until the worker group has failed or the engine shut down."""
        while not self._dead_event.wait(0.5 if timeout is None else timeout):
            if self._closing or timeout is not None:
                break
        return self._dead is not None

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._closing

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    def stalled_for(self) -> float:
        """Seconds since the last completed step while requests are in flight; 0 when idle."""
        if not self._sinks:
            return 0.0
        return time.monotonic() - self.stats.last_progress

    # --- outputs ---------------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while not self._closing:
            try:
                if not self._from_leader.poll(100):
                    continue
                msg = self._from_leader.recv_pyobj()
            except zmq.ZMQError:
                return
            if isinstance(msg, Fatal):
                if msg.kind == "RankDivergenceError":
                    self.stats.rank_divergences += 1
                self._observe(self.on_fatal, msg)
                self._mark_dead(msg.message)
                continue
            if not isinstance(msg, StepReport):
                continue
            if msg.stats is not None:
                self.stats.snapshot = msg.stats
            self.stats.last_progress = time.monotonic()
            for out in msg.outputs:
                with self._lock:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None and out.finish_reason is not None:
                        self._drop(out.request_id)
                if sink is not None:
                    sink.put(out)
            self._observe(self.on_step, msg)

    def _observe(self, callback: Callable | None, msg) -> None:
        """Run an observer (the server's metrics) on the receiver thread. Its failure is logged (the first with its
        traceback) and never ends the thread that delivers every request's outputs: requests in flight would hang."""
        if callback is None:
            return
        try:
            callback(msg)
        except Exception:  # noqa: BLE001 - an observer's bug must not stop output delivery
            self.observer_errors += 1
            if self.observer_errors == 1:
                log.exception("engine observer %r failed on a %s; outputs keep flowing", callback, type(msg).__name__)

    # --- requests --------------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        """Control messages (aborts, shutdown), never waiting on rank 0: one that finds the inbox full is dropped
        (the request then runs to its own end on rank 0; its client is gone)."""
        with self._lock:
            try:
                self._to_leader.send_pyobj(msg, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("rank 0's inbox is full; dropped a %s", type(msg).__name__)

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]], sinks: list[_Sink]) -> None:
        """Dispatch a batch of requests to rank 0 in one message."""
        for _, _, params in requests:
            params.validate(self.model_cfg.vocab_size)
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if self._closing:
                raise EngineDeadError("engine is shutting down")
            self._admit(requests)
            if not self._sinks:
                self.stats.last_progress = time.monotonic()  # idle until now: the stall clock starts here
            for (rid, ids, _), sink in zip(requests, sinks):
                if rid in self._sinks:
                    raise InvalidParameterError("request_id", f"request id {rid!r} is already in flight")
                sink.prompt_tokens = len(ids)
                self._sinks[rid] = sink
                self._prompt_tokens += len(ids)
            msg = AddRequests([AddRequest(rid, list(ids), p) for rid, ids, p in requests])
            try:
                if not self._to_leader.poll(SEND_WAIT_MS, zmq.POLLOUT):  # a bounded wait, never an unbounded one
                    raise zmq.Again()
                self._to_leader.send_pyobj(msg, zmq.NOBLOCK)
            except zmq.Again:
                for rid, _, _ in requests:
                    self._drop(rid)
                raise EngineInboxFullError("rank 0 is not taking requests (its inbox is full): retry later") from None

    @property
    def queue_limits(self) -> tuple[int, int]:
        """(requests, prompt tokens) the engine holds in flight at most: the running batch and the KV pool, plus
        `max_queued_requests` and `max_queued_tokens` queued past them (defaults: 8 batches, 4 pools)."""
        cfg, pool = self.config, self.ready.kv_total_tokens
        queued = cfg.max_queued_requests if cfg.max_queued_requests is not None else 8 * cfg.max_running_requests
        tokens = cfg.max_queued_tokens if cfg.max_queued_tokens is not None else 4 * pool
        return cfg.max_running_requests + queued, pool + tokens

    def _admit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Refuse a batch (all its n choices count) that would pass the queue limits; the caller holds the lock."""
        max_requests, max_tokens = self.queue_limits
        if len(self._sinks) + len(requests) > max_requests:
            raise EngineBusyError(f"{len(self._sinks)} requests in flight, the limit is {max_requests}: retry later")
        tokens = sum(len(ids) for _, ids, _ in requests)
        if self._sinks and self._prompt_tokens + tokens > max_tokens:
            raise EngineBusyError(
                f"{self._prompt_tokens} prompt tokens in flight, the limit is {max_tokens}: retry later"
            )

    def abort(self, request_id: str) -> None:
        """Ask rank 0 to drop a request; it frees the KV slots on every rank by its next step."""
        if self._dead is None and not self._closing:
            try:
                self._send(AbortRequest(request_id))
            except zmq.ZMQError:
                pass

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        timeout: float | None = None,
    ) -> list[GenerationResult]:
        """Offline batch generation: submits every prompt at once and waits for all of them."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.encode(p) for p in prompts]
        rids = [f"gen-{uuid.uuid4().hex[:12]}" for _ in prompts]
        queues = [queue.SimpleQueue() for _ in prompts]
        self.submit(list(zip(rids, ids, params_list)), [_Sink(q.put) for q in queues])
        results = []
        for rid, prompt_ids, q, p in zip(rids, ids, queues, params_list):
            tokens: list[int] = []
            logprobs: list[TokenLogprobs] | None = [] if p.logprobs is not None else None
            while True:
                item = q.get(timeout=timeout)
                if isinstance(item, Exception):
                    raise item
                assert isinstance(item, RequestOutput)
                if item.error:
                    raise RequestFailedError(item.error)
                tokens.extend(item.token_ids)
                if logprobs is not None and item.logprobs:
                    logprobs.extend(item.logprobs)
                if item.finish_reason is not None:
                    break
            results.append(
                GenerationResult(
                    rid,
                    prompt_ids,
                    tokens,
                    self.tokenizer.decode(tokens, skip_special_tokens=True),
                    item.finish_reason,
                    logprobs,
                )
            )
        return results

    def add_async(self, requests: list[tuple[str, list[int], SamplingParams]]) -> list[AsyncRequest]:
        """Submit a batch from an asyncio loop; each AsyncRequest yields its RequestOutputs."""
        loop = asyncio.get_running_loop()
        handles = [AsyncRequest(self, rid, loop) for rid, _, _ in requests]
        self.submit(requests, [h.sink for h in handles])
        return handles

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs as rank 0 produces them; leaving early aborts the request on every rank."""
        (handle,) = self.add_async([(request_id or f"req-{uuid.uuid4().hex}", prompt_ids, params)])
        try:
            while not handle.finished:
                yield await handle.next()
        finally:
            handle.cancel()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        """Forget a request's sink (the caller holds the lock)."""
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            self._prompt_tokens -= sink.prompt_tokens

    # --- lifecycle -------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        self._dead_event.set()
        if self._dead is None:
            try:
                self._send(Shutdown())
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill_workers()
        with self._lock:
            sinks = list(self._sinks.values())
            self._sinks.clear()
            self._prompt_tokens = 0
        for sink in sinks:
            sink.put(EngineDeadError("engine shut down"))
        self._receiver.join(timeout=2)
        self._to_leader.close()
        self._from_leader.close()
        self._zctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_follower_ranks(config: EngineConfig) -> list[mp.Process]:
    """A node other than 0 in a multi-node TP group: start the local ranks, which join rank 0's rendezvous."""
    config.validate()
    if not config.dist_init_addr:
        raise ValueError("--dist-init-addr is required when --node-rank > 0")
    ctx = rank_context(config.device)
    local = config.local_tp_size
    procs = []
    for local_rank in range(local):
        rank = config.node_rank * local + local_rank
        p = ctx.Process(
            target=run_rank,
            args=(config, rank, local_rank, f"tcp://{config.dist_init_addr}", "", "", dict(os.environ)),
            name=f"eaglegate-tp{rank}",
        )
        p.start()
        procs.append(p)
    return procs


def wait_follower_ranks(procs: list[mp.Process]) -> int:
    """Run until any local rank ends (rank 0 shut the group down, or a rank failed), then stop the others."""
    wait_sentinels([p.sentinel for p in procs])
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)
