"""`make serve` as the README gives it answers a chat request; SIGTERM drains, stops the workers, exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from devtools.server import alive, descendants
from worker.dist import free_port

ROOT = Path(__file__).resolve().parents[2]


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "make serve exited early"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)  # waiting for start-up, bounded by the deadline
    raise AssertionError("server did not become healthy")


def test_serving_every_interface_without_a_key_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "EAGLEGATE_API_KEY"}
    cmd = [sys.executable, "-m", "server", "serve", "--host", "0.0.0.0", "--port", str(free_port())]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "refusing to serve 0.0.0.0 without an API key" in r.stderr, r.stderr
    assert "--allow-unauthenticated" in r.stderr and "Traceback" not in r.stderr


def test_make_serve_answers_chat_and_sigterm_exits_cleanly(smol_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        ["make", "-s", "serve", f"ARGS=--port {port}"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Say hi in three words."}],
            max_tokens=16,
        )
        assert r.choices[0].message.content.strip()
        tree = descendants(proc.pid)
        assert len(tree) >= 3  # make -> eaglegate -> at least one TP worker
        argv = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in tree}
        server_pid = next(p for p in tree if b"serve" in argv[p] and any(a.endswith(b"eaglegate") for a in argv[p]))
        os.kill(server_pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)  # workers exit right after the front end; bounded wait
        assert not alive(tree), f"orphans left: {alive(tree)}"
        log.seek(0)
        out = log.read()
        assert "listening on" in out and "eaglegate: stopped" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
