"""The fused CPU kernels of cpu_kernels.cpp, compiled once per machine (about a minute, then cached in .cache/).

`ops(device)` gives the compiled module where it applies (CPU tensors) and None elsewhere, or when the build failed
(a warning says why; the eager torch path then runs) or `EAGLEGATE_CPU_KERNELS=0` turns it off. A process decides
once, so every step of an engine takes the same path and speculative output stays equal to plain output.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_suffix(".cpp")
BUILD_DIR = Path(os.environ.get("EAGLEGATE_CACHE", Path(__file__).resolve().parent.parent / ".cache")) / "cpu_kernels"
_module: object | None = None
_tried = False


def build():
    """Compile (or load the cached build of) the extension; raises if the compiler fails."""
    from torch.utils.cpp_extension import load

    try:  # the pinned ninja wheel's binary, which torch looks for on PATH (a venv's bin is not on it unless activated)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    return load(name="eaglegate_cpu_kernels", sources=[str(SOURCE)], build_directory=str(BUILD_DIR),
                extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def ops(device: torch.device):
    """The compiled kernels for tensors on `device`, or None where the eager path must run. Called per op, so cheap."""
    if device.type != "cpu":
        return None
    if not _tried:
        _load()
    return _module


def _load() -> None:
    global _module, _tried
    _tried = True
    if os.environ.get("EAGLEGATE_CPU_KERNELS", "1") == "0":
        return
    try:
        _module = build()
    except Exception as e:  # noqa: BLE001 - any build failure means: run the eager path, and say so
        log.warning("fused CPU kernels unavailable, running eager torch ops instead: %s", e)


if __name__ == "__main__":  # `python -m worker.cpu_kernels`: build ahead (make setup does)
    build()
    print(f"fused CPU kernels built in {BUILD_DIR}")
