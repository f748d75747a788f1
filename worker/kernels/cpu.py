"""The fused CPU kernels of cpu_kernels.cpp, compiled once per machine (about 40 s, then cached in .cache/).

`ops(device)` gives the compiled module for CPU tensors; None elsewhere, after a failed build (with a warning; the
eager torch path runs) or with `EAGLEGATE_CPU_KERNELS=0`. A process decides once, so every step takes the same path
and speculative output stays equal to plain output.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from worker.kernels.cpu_class import build_flags, describe

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"  # includes the other files of csrc/
CACHE = Path(os.environ.get("EAGLEGATE_CACHE", Path(__file__).resolve().parents[2] / ".cache"))
_module: object | None = None
_tried = False
_lock = threading.Lock()


def _cpu_key() -> str:
    """The build is -march=native: key it by the CPU's flags, so a shared checkout never loads another CPU's binary."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


# Extra compiler flags: a CPU class's (cpu_class.py) and EAGLEGATE_CPU_FLAGS, e.g. "-march=haswell" to build the
# paths of a CPU without AVX-512 on one that has it (a build directory of its own).
EXTRA_FLAGS = build_flags()


def build_dir() -> Path:
    """Keyed by the CPU, the extra flags and the sources (torch's own check hashes only the .cpp, not its headers)."""
    key = hashlib.sha256(" ".join(EXTRA_FLAGS).encode())
    for f in sorted(SOURCE.parent.iterdir()):
        key.update(f.read_bytes())
    return CACHE / f"cpu_kernels-{_cpu_key()}-{key.hexdigest()[:8]}"


def build():
    """Compile (or load the cached build of) the extension; raises if the compiler fails."""
    from torch.utils.cpp_extension import load

    try:  # the pinned ninja wheel's binary, which torch looks for on PATH (a venv's bin is not on it unless activated)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a file that outlives a killed builder and then blocks every later process; builders
    # here take a flock first (released by the kernel if its holder dies), so a lock file found under it is stale
    with open(out / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (out / "lock").unlink(missing_ok=True)
        return load(
            name="eaglegate_cpu_kernels",
            sources=[str(SOURCE)],
            build_directory=str(out),
            extra_cflags=["-O3", "-march=native", *EXTRA_FLAGS, "-fno-math-errno", "-fno-trapping-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def ops(device: torch.device):
    """The compiled kernels for tensors on `device`, or None where the eager path must run. Called per op, so cheap."""
    if device.type != "cpu":
        return None
    if not _tried:
        _load()
    return _module


def _load() -> None:
    global _module, _tried
    with _lock:
        if _tried:
            return
        if os.environ.get("EAGLEGATE_CPU_KERNELS", "1") != "0":
            try:
                _module = build()
            except Exception as e:  # noqa: BLE001 - any build failure means: run the eager path, and say so
                log.warning("fused CPU kernels unavailable, running eager torch ops instead: %s", e)
        _tried = True


if __name__ == "__main__":  # `python -m worker.kernels.cpu` (make serve/test): build ahead
    # a failed build leaves serving on the eager path, but under CI=true it is an error: a green run has tested them
    logging.basicConfig(level=logging.WARNING)
    _load()
    if _module is None:
        print("fused CPU kernels not built: the eager torch path will run")
        raise SystemExit(1 if os.environ.get("CI") == "true" else 0)
    flags = " ".join(EXTRA_FLAGS) or "-march=native"
    print(f"fused CPU kernels built in {build_dir()} ({flags}; this CPU: {describe()})")
