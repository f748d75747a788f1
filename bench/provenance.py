"""What every benchmark JSON records beside its figures: the command, the commit, the machine, the date."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch


def _cpu_features() -> str:
    """The vector units the kernels choose by (machines here differ from session to session)."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return ""
    have = [name for name, flag in (("AVX512-BF16", "avx512_bf16"), ("AMX-BF16", "amx_bf16")) if flag in flags]
    return f", {' + '.join(have) or 'no AVX512-BF16'}"


def provenance() -> dict:
    # the device machine gets a copy of the tree without .git: scripts/device-check.sh passes the commit along
    commit = os.environ.get("EAGLEGATE_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                  text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit + ("+dirty" if dirty else ""),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
                       f"{_cpu_features()}",
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
