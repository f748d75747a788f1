"""A real `eaglegate serve` in a subprocess, and the processes it leaves behind (read from /proc)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from worker.dist import free_port

API_KEY = "sk-test-eaglegate-123"


def descendants(pid: int) -> set[int]:
    """All live descendant pids of a process, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


# a restarting parent, as Docker's `restart: on-failure` or a Kubernetes pod is: runs the command again after a
# non-zero exit, forwards SIGTERM to it, and exits with its status once it exits 0 or was told to stop
RESTARTER = """
import signal, subprocess, sys
state = {"child": None, "stopping": False}
def forward(*_):
    state["stopping"] = True
    if state["child"] is not None:
        state["child"].terminate()
signal.signal(signal.SIGTERM, forward)
while True:
    state["child"] = subprocess.Popen(sys.argv[1:])
    rc = state["child"].wait()
    if rc == 0 or state["stopping"]:
        sys.exit(rc)
    print(f"restarter: the server exited with {rc}; starting it again", flush=True)
"""


class ServerProcess:
    """A real `python -m server serve` subprocess on a free port (under a restarting parent with `restart`)."""

    def __init__(self, args: list[str], api_key: str | None = None, env: dict | None = None, restart: bool = False):
        import shutil
        import subprocess
        import tempfile

        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="eaglegate-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "server", "serve", "--port", str(self.port), *args]
        key_dir = Path(tempfile.mkdtemp(prefix="eaglegate-key-"))
        if api_key:  # from a file, as an operator would: the key stays out of the process table
            (key_dir / "key").write_text(api_key + "\n")
            cmd += ["--api-key-file", str(key_dir / "key")]
        if restart:
            cmd = [sys.executable, "-c", RESTARTER, *cmd]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self.wait_healthy()
        finally:
            shutil.rmtree(key_dir, ignore_errors=True)  # read at start-up, before the server is healthy

    def wait_healthy(self, timeout: float = 180.0) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # waiting for start-up, bounded by the deadline
        raise RuntimeError(f"server not healthy within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.base_url + "/engine/stats", headers=self.headers(), timeout=5).json()

    def stop(self, timeout: float = 30.0) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
