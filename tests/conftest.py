"""Session fixtures: the default model is loaded once per test session and shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GPU kernels run on CPU tensors through Triton's interpreter (set before anything imports triton); the device
# check sets TRITON_INTERPRET=0 to run them for real
os.environ.setdefault("TRITON_INTERPRET", "1")

from devtools.server import API_KEY, ServerProcess  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.model.files import GGUF_NAME, fetch_default_model  # noqa: E402


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
def served_engine(smol_dir):
    """The default model as `eaglegate serve` runs it (the file's quantized weights on this CPU's auto kernel, its
    auto dtype), tp=1, no speculation: the reference where a test's claim holds on any numerics (batch
    independence, lossless speculation, sampling controls), several times faster to decode than float32."""
    eng = Engine(EngineConfig(max_total_tokens=16384))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def hf_smol(smol_dir):
    """transformers' own load of the same GGUF, float32: the reference for logits and greedy text."""
    from devtools.models import transformers_reference

    return transformers_reference(smol_dir, GGUF_NAME)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smol_dir) -> Path:
    from devtools.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", heads=8, kv_heads=4)


@pytest.fixture(scope="session")
def api_server(smol_dir):
    server = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "16384", "--speculative-algorithm", "NONE"], api_key=API_KEY
    )
    yield server
    server.stop()
