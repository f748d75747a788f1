"""What every benchmark JSON records beside its figures: the command, the commit, the machine, the date."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch


def provenance() -> dict:
    # the device machine gets a copy of the tree without .git: scripts/device-check.sh passes the commit along
    commit = os.environ.get("EAGLEGATE_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                  text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit + ("+dirty" if dirty else ""),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
