"""Session fixtures: the default model is loaded once per test session and shared."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from worker.config import EngineConfig  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.model_files import GGUF_NAME, default_model_dir, fetch_default_model  # noqa: E402


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
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


assert default_model_dir  # re-exported for tests
