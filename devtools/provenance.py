"""Where benchmark results go and what each records beside its figures: the command, the commit, the machine, the
date.

A result is named `<benchmark>[-<machine class>].<json|png>` in bench/results/: the benchmark is the stem of its
script in bench/, the machine class one of `MACHINES`; no class names the reference machine (an Intel Xeon with
AMX); GPU results always name their GPU class.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
MACHINES = {
    "epyc": "AMD EPYC with AVX512-BF16, no AMX",
    "xeon": "Intel Xeon without AVX512-BF16",
    "h100": "NVIDIA H100",
    "h200": "NVIDIA H200",
    "mi355x": "AMD Instinct MI355X",
}
RESULT_NAME = re.compile(rf"(?P<benchmark>[a-z][a-z0-9_]*)(?:-(?P<machine>{'|'.join(MACHINES)}))?\.(?:json|png)")


def add_machine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--machine",
        choices=sorted(MACHINES),
        default=None,
        help="machine class the results file is named after: "
        + "; ".join(f"{k}: {v}" for k, v in MACHINES.items())
        + " (default: none, the reference machine, an Intel Xeon with AMX)",
    )


def is_result_name(name: str) -> bool:
    """Whether `name` follows the naming rule, its benchmark a script in bench/."""
    m = RESULT_NAME.fullmatch(name)
    return bool(m) and (RESULTS.parent / f"{m['benchmark']}.py").exists()


def result_path(benchmark: str, machine: str | None = None, suffix: str = ".json") -> Path:
    """bench/results/<benchmark>[-<machine>]<suffix>, created folder included."""
    if machine is not None and machine not in MACHINES:
        raise ValueError(f"unknown machine class {machine!r}; one of {', '.join(MACHINES)}")
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"{benchmark}{'-' + machine if machine else ''}{suffix}"


def _cpu_features() -> str:
    """The vector units the CPU kernels choose by."""
    try:
        flags = set(
            next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
            .split(":", 1)[1]
            .split()
        )
    except (OSError, StopIteration):
        return ""
    named = (("AVX2", "avx2"), ("AVX512-VNNI", "avx512_vnni"), ("AVX512-BF16", "avx512_bf16"), ("AMX-BF16", "amx_bf16"))
    have = [name for name, flag in named if flag in flags]
    return f", {' + '.join(have)}{'' if 'avx512_bf16' in flags else ', no AVX512-BF16'}"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on this host
        return ""


def provenance() -> dict:
    # EAGLEGATE_COMMIT names the commit where the tree has no .git (scripts/gpu-check.sh sets it from a bundle)
    commit = os.environ.get("EAGLEGATE_COMMIT") or _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit + ("+dirty" if dirty else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
        f"{_cpu_features()}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
