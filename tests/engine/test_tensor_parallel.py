"""Greedy output at tp=N is token-identical to tp=1 (real gloo process groups)."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from worker.config import EngineConfig
from worker.model.files import ModelLoadError
from worker.sampling.params import SamplingParams

PROMPT_IDS = [[1, 504, 3060, 282, 4649, 314], [22, 1534, 7], [9, 9, 9, 9, 100, 200, 300, 400, 500, 600, 700]]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def _greedy(config: EngineConfig, prompts) -> list[list[int]]:
    with Engine(config) as eng:
        return [r.token_ids for r in eng.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama):
    return _greedy(EngineConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=1024), PROMPT_IDS)


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_llama_tp_matches_tp1(tiny_llama, tiny_reference, tp):
    # 8 heads / 4 KV heads: tp=2 splits KV heads, tp=4 gives each rank one
    out = _greedy(
        EngineConfig(model_path=str(tiny_llama), dtype="float32", tp_size=tp, max_total_tokens=1024), PROMPT_IDS
    )
    assert out == tiny_reference


def test_tp_that_does_not_divide_heads_is_refused(smol_dir):
    with pytest.raises(ModelLoadError, match="does not divide the 9 attention heads"):
        Engine(EngineConfig(tp_size=2))


def test_tiny_qwen3_matches_transformers_greedy_at_tp1_2_and_4(tmp_path, smol_dir):
    """Qwen3's per-head q/k norms are replicated on every rank; the heads they scale are split (8 heads, 4 KV
    heads: tp=4 gives each rank one KV head). 32-token greedy output equals transformers' at every tp."""
    import torch
    from transformers import AutoModelForCausalLM

    from devtools.models import save_tiny_model

    folder = str(save_tiny_model(tmp_path / "qwen3", "qwen3", heads=8, kv_heads=4, seed=5))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[
                0, len(ids) :
            ].tolist()
            for ids in PROMPT_IDS
        ]
    for tp in (1, 2, 4):
        with Engine(EngineConfig(model_path=folder, dtype="float32", tp_size=tp, max_total_tokens=1024)) as eng:
            assert [r.token_ids for r in eng.generate(PROMPT_IDS, params)] == ref, f"tp={tp}"
