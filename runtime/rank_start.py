"""How rank processes start: forked from a server that has imported torch already, or spawned fresh.

A spawned rank imports torch and the worker before it can load anything: about 1.3 s of CPU per rank, paid again at
each restart of the group and by every rank of a TP group at once. On CPU devices the ranks are forked from
multiprocessing's forkserver instead, which imports `runtime.rank_main` once (no thread and no device is started
by an import, so forking after it is safe). GPUs keep spawn: a CUDA or HIP runtime must never be inherited.

A forked rank sees the forkserver's environment, frozen when it started, not the engine's now. So the engine
passes its environment with the start arguments and the rank adopts it first (`begin_rank`); and where a
variable that libraries read while importing (torch's CPU capability, oneDNN's ISA cap, OpenMP, Triton, the
project's own switches) differs from the forkserver's, the ranks are spawned, so they import under the new value.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.context import BaseContext

PRELOAD = ["runtime.rank_main"]
# read while importing torch, oneDNN, OpenMP, Triton or the project: a forked rank could not see a new value
IMPORT_TIME_ENV = ("EAGLEGATE_", "ATEN_", "ONEDNN_", "DNNL_", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH", "PYTORCH_",
                   "TRITON_", "LD_", "PYTHON")  # fmt: skip

_forkserver_env: dict[str, str] | None = None  # the import-time environment the forkserver started under


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV)}


def rank_context(device: str) -> BaseContext:
    """The multiprocessing context to start this engine's ranks with (see the module's docstring)."""
    global _forkserver_env
    if sys.platform != "linux" or device == "cuda" or (device == "auto" and gpu_present()):
        return mp.get_context("spawn")
    env = _import_time_env()
    if _forkserver_env is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _forkserver_env = env  # the forkserver starts with the first rank, under this environment
        return ctx
    return mp.get_context("forkserver" if env == _forkserver_env else "spawn")


def gpu_present() -> bool:
    """A CUDA or ROCm device node exists: a guess that needs no torch import (so the forkserver can start before
    the front end imports anything heavy); where it errs, it errs towards spawn, which works everywhere."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))


def prestart(device: str) -> None:
    """Start the forkserver now, so its import of torch runs beside the front end's imports and tokenizer load
    rather than after them (about 1.5 s of a server's start-up on two cores)."""
    if rank_context(device).get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def begin_rank(env: dict[str, str]) -> None:
    """In a rank, first: take the engine's environment as it was when the rank was started, and let go of the
    forkserver's "alive" pipe. The forkserver gives every process it forks the pipe's write end and exits only when
    no process holds it; a rank holding it would keep the forkserver up after the engine's process died, and the
    forkserver keeps the rank up (its parent-death signal), so both would outlive a killed engine."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the module's own instance: in a forked rank, what it inherited
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)
