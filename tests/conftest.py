"""Session fixtures: the default model is loaded once per test session and shared."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GPU kernels run on CPU tensors through Triton's interpreter (set before anything imports triton); the device
# check sets TRITON_INTERPRET=0 to run them for real
os.environ.setdefault("TRITON_INTERPRET", "1")

from runtime.engine import Engine  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.dist import free_port
from worker.model.files import GGUF_NAME, default_model_dir, fetch_default_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped without a GPU, except under the device check (EAGLEGATE_REQUIRE_CUDA=1),
    where a missing GPU stops the run instead of skipping them silently."""
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("EAGLEGATE_REQUIRE_CUDA") == "1":
        pytest.exit("EAGLEGATE_REQUIRE_CUDA=1 but torch sees no CUDA/HIP device", returncode=3)
    skip = pytest.mark.skip(reason="needs a CUDA/HIP device (scripts/gpu-check.sh runs these)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# The only skips CI accepts: hardware this machine lacks. Under CI=true any other skip (a kernel build that failed, a
# missing promtool or Prometheus, a missing package) fails the test instead, so a green run has run everything else.
HARDWARE_SKIPS = ("needs a CUDA/HIP device", "needs AVX512-BF16", "needs AMX", "needs AVX2", "needs AVX-512")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true" and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith(HARDWARE_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI, where only missing hardware may skip a test: {reason}"


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    return fetch_default_model(quiet=True)


@pytest.fixture(scope="session")
def smol_engine(smol_dir):
    """SmolLM2-135M-Instruct at tp=1 in float32: the reference engine most tests share."""
    eng = Engine(EngineConfig(dtype="float32", max_total_tokens=16384))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def hf_smol(smol_dir):
    """transformers' own load of the same GGUF, float32: the reference for logits and greedy text."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smol_dir) -> Path:
    from helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", heads=8, kv_heads=4)


def chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


assert default_model_dir  # re-exported for tests


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


API_KEY = "sk-test-eaglegate-123"


@pytest.fixture(scope="session")
def api_server(smol_dir):
    server = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "16384", "--speculative-algorithm", "NONE"], api_key=API_KEY
    )
    yield server
    server.stop()
