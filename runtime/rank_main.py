"""Entry point of one TP worker process: join the group, load the shard, then lead (rank 0) or follow."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from speculative.leader import make_spec_follower, make_spec_leader
from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.forensics import FlightRecorder, Heartbeat, dump_on_signal, heartbeat_path
from worker.kernels import cpu_choice
from worker.kernels.quant import resolve_quantization
from worker.leader import Leader, follower_step
from worker.model.files import forget_gguf, resolve_model
from worker.model.loader import resolve_dtype, will_quantize
from worker.protocol import Fatal, ForwardPlan, IdlePlan, Ready, Shutdown, ShutdownPlan, SpecPlan, StepPlan
from worker.runner import ModelRunner

from .agreement import StartupMismatchError, agree
from .rank_start import begin_rank

HEARTBEAT_S = 1.0  # an idle leader broadcasts this often so followers' collectives never time out
GRAMMAR_POLL_MS = 5  # how often an idle leader looks for a finished grammar compile


def pick_device(config: EngineConfig, local_rank: int) -> torch.device:
    want = config.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_group(config: EngineConfig, rank: int, local_rank: int, init_method: str) -> TPGroup:
    device = pick_device(config, local_rank)
    timeout = timedelta(seconds=config.dist_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"  # ROCm builds map "nccl" to RCCL
    if config.tp_size == 1:
        return TPGroup(0, 1, device)
    dist.init_process_group(backend, init_method=init_method, world_size=config.tp_size, rank=rank, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return TPGroup(rank, config.tp_size, device, dist.group.WORLD, cpu_group)


def die_with_parent(rank: int) -> None:
    """Linux: the kernel kills this worker when the process that started it dies (the engine's process, or the
    forkserver, which exits with it), so none is orphaned; and `ps`, `top` and the tests see it as eaglegate-tpN."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, f"eaglegate-tp{rank}".encode()[:15])  # PR_SET_NAME: /proc/PID/comm
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def run_rank(
    config: EngineConfig, rank: int, local_rank: int, init_method: str, in_addr: str, out_addr: str, env: dict
) -> None:
    begin_rank(env)
    die_with_parent(rank)
    local = config.local_tp_size
    torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // local))
    ctx = outbox = tp = None
    try:
        if rank == 0:
            import zmq

            ctx = zmq.Context()
            outbox = ctx.socket(zmq.PUSH)
            outbox.setsockopt(zmq.LINGER, 2000)
            outbox.connect(out_addr)
        tp = init_group(config, rank, local_rank, init_method)
        tp.recorder = FlightRecorder(rank)
        if out_addr:  # node 0: the heartbeat beside the engine's sockets, where the front end reads it
            tp.heartbeat = Heartbeat(heartbeat_path(Path(out_addr.removeprefix("ipc://")).parent, rank))
        if config.crash_dump_folder:  # a rank stuck in a collective never reaches `except`: SIGUSR1 dumps it
            dump_on_signal(lambda: _dump(config, tp, _group_id(init_method, out_addr), TimeoutError("stopped")))
        if config.debug_collective_trace:
            tp.trace = []
        source = resolve_model(config.model_path)
        cpu_kernel = _agree(config, source, tp)
        runner = ModelRunner(config, source, tp, show_progress=rank == 0)
        forget_gguf()
        if rank == 0:
            _lead(config, runner, tp, ctx, in_addr, outbox, cpu_kernel)
        else:
            _follow(config, runner, tp)
    except BaseException as e:  # report, then exit non-zero so the supervisor fails fast
        if config.crash_dump_folder and tp is not None:
            _dump(config, tp, _group_id(init_method, out_addr), e)
        if outbox is not None:
            outbox.send_pyobj(Fatal(f"rank {rank}: {type(e).__name__}: {e}", type(e).__name__))
            outbox.close(linger=2000)  # deliver the report before exiting: os._exit drops queued messages
            ctx.term()
        if isinstance(e, StartupMismatchError):
            print(f"eaglegate rank {rank}: {e}", file=sys.stderr, flush=True)
        elif not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
        os._exit(1)
    finally:
        if tp is not None and tp.trace is not None:
            with open(os.path.join(config.debug_collective_trace, f"rank{rank}.json"), "w") as f:
                json.dump(tp.trace, f)
        if dist.is_initialized():
            dist.destroy_process_group()
    if ctx is not None:
        ctx.destroy(linger=2000)  # deliver the last report before exiting
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: a gloo worker thread may still be freeing its last broadcast's tensors, and
    # taking the GIL from a finalising interpreter aborts the process (seen as exit -6 on follower ranks).
    os._exit(0)


def _group_id(init_method: str, out_addr: str) -> str:
    """The same on every rank of one worker group, new for each group: node 0's run folder is made per group;
    other nodes add their serving process (the same for the node's ranks, new when the node restarts)."""
    group = hashlib.sha1(init_method.encode()).hexdigest()[:10]
    if out_addr:
        return f"{group}-{Path(out_addr.removeprefix('ipc://')).parent.name}"
    return f"{group}-{socket.gethostname()}-{os.getppid()}"


def _dump(config: EngineConfig, tp: TPGroup, group: str, error: BaseException) -> None:
    """Write this rank's flight record; a dump that fails is logged, never in the way of the failure's report."""
    if not tp.recorder.records:
        return
    try:
        path = tp.recorder.dump(Path(config.crash_dump_folder), group, tp.size, error)
        print(f"eaglegate rank {tp.rank}: crash dump in {path}", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - the failure being reported matters more
        print(f"eaglegate rank {tp.rank}: could not write the crash dump: {e}", file=sys.stderr, flush=True)


def _agree(config: EngineConfig, source, tp: TPGroup) -> str:
    """Every rank states what it will load and serve; any difference stops every rank before loading. Returns the
    CPU kernel this process runs ("" on GPUs)."""

    kernel, refusal = "", None
    if tp.device.type == "cpu":  # first: the weights' layout and the auto dtype follow it
        try:
            kernel = str(cpu_choice.select(config.cpu_kernel))
        except ValueError as e:  # after the agreement, so every rank stops with the same message
            kernel, refusal = f"refused: {e}", e
    dtype = resolve_dtype(config.dtype, tp.device, will_quantize(config, source))
    try:
        method = resolve_quantization(config.quantization, dtype, tp.device, source.kind, config.dtype)
    except ValueError as e:  # refused below, on every rank alike, with the loader's message
        method = f"refused: {e}"
    agree(config, source, tp, dtype, method, kernel)
    if refusal is not None:
        raise refusal
    return kernel


def _make_leader(config, runner, tp):
    if config.spec.enabled:
        return make_spec_leader(config, runner, tp)
    return Leader(config, runner, tp)


def _lead(config, runner, tp: TPGroup, ctx, in_addr: str, outbox, cpu_kernel: str) -> None:
    import zmq

    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    leader = _make_leader(config, runner, tp)
    outbox.send_pyobj(Ready(runner.num_blocks * runner.block_size, leader.max_model_len, cpu_kernel))
    last_broadcast = time.monotonic()
    stopping = False
    while True:
        idle_ms = GRAMMAR_POLL_MS if leader.waiting_on_grammars() else int(HEARTBEAT_S * 1000)
        timeout_ms = 0 if leader.has_work() else idle_ms
        if inbox.poll(timeout_ms):
            while True:
                try:
                    msg = inbox.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if isinstance(msg, Shutdown):
                    stopping = True
                else:
                    leader.handle(msg)
        if stopping:
            break
        leader.admit_compiled()
        leader.expire()
        stepped = leader.has_work()
        if stepped:
            leader.step()
            last_broadcast = time.monotonic()
        elif tp.size > 1 and time.monotonic() - last_broadcast >= HEARTBEAT_S:
            tp.broadcast_object(IdlePlan(leader.step_no))
            last_broadcast = time.monotonic()
        report = leader.take_report(stepped)
        if report is not None:
            outbox.send_pyobj(report)
    leader.fail_all("engine shut down")
    report = leader.take_report()
    if report is not None:
        outbox.send_pyobj(report)
    tp.broadcast_object(ShutdownPlan(leader.step_no))


def _follow(config, runner, tp: TPGroup) -> None:
    """Execute rank 0's plans until it says shutdown; no scheduling state lives here."""
    spec_step = None
    if config.spec.enabled:
        spec_step = make_spec_follower(config, runner, tp)
    while True:
        plan: StepPlan = tp.broadcast_object()
        if isinstance(plan, ShutdownPlan):
            return
        if isinstance(plan, ForwardPlan):
            follower_step(config, runner, tp, plan)
        elif isinstance(plan, SpecPlan):
            spec_step(plan)
