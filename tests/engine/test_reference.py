"""Correctness against Hugging Face transformers on the same weights (float32)."""

from __future__ import annotations

import torch

from devtools.prompts import chat
from worker.config import EngineConfig
from worker.dist import single_rank_group
from worker.model.files import resolve_model
from worker.protocol import ForwardPlan
from worker.runner import ModelRunner
from worker.sampling.params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1492, Columbus sailed across the Atlantic Ocean and",
]


def _runner(config: EngineConfig) -> ModelRunner:
    return ModelRunner(config, resolve_model(config.model_path), single_rank_group(torch.device("cpu")))


def test_prefill_and_decode_logits_match_transformers(hf_smol, smol_engine):
    runner = _runner(EngineConfig(dtype="float32", max_total_tokens=512))
    tok = smol_engine.tokenizer
    for i, text in enumerate(PROMPTS + [chat(smol_engine, "Tell me about owls.")]):
        ids = tok.encode(text, add_special_tokens=False)
        n = len(ids)
        blocks = list(range(runner.num_blocks))
        logits, _, _ = runner.forward(ForwardPlan(1, ids, [(0, n, blocks)], list(range(n))))
        with torch.no_grad():
            ref = hf_smol(torch.tensor([ids])).logits[0]
        rel = ((logits - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-3, f"prompt {i}: prefill relative error {rel}"
        # one decode step on top of the cache just written
        nxt = int(ref[-1].argmax())
        logits, _, _ = runner.forward(ForwardPlan(2, [nxt], [(n, 1, blocks)], [0]))
        with torch.no_grad():
            ref2 = hf_smol(torch.tensor([ids + [nxt]])).logits[0, -1]
        rel = ((logits[0] - ref2).abs().max() / ref2.abs().max()).item()
        assert rel <= 1e-3, f"prompt {i}: decode relative error {rel}"


def test_greedy_continuation_is_transformers_greedy_choice_at_every_token(hf_smol, smol_engine):
    """64 greedy tokens: each is transformers' argmax given the prompt and the tokens before it (one teacher-forced
    forward over the whole continuation: what `generate(do_sample=False)` picks, without 64 sequential steps)."""
    tok = smol_engine.tokenizer
    for text in [chat(smol_engine, "Write a short story about a dragon who learns to bake."), PROMPTS[2]]:
        ids = tok.encode(text, add_special_tokens=False)
        ours = smol_engine.generate([ids], SamplingParams(max_new_tokens=64, temperature=0))[0].token_ids
        with torch.no_grad():
            logits = hf_smol(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == ours
        assert len(ours) == 64 or ours[-1] in smol_engine.model_cfg.eos_token_ids


def test_other_families_match_transformers(tmp_path, smol_dir):
    """Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) layouts, random weights saved as safetensors."""
    from transformers import AutoModelForCausalLM

    from devtools.models import save_tiny_model

    for arch in ("mistral", "qwen2", "qwen3"):
        folder = save_tiny_model(tmp_path / arch, arch, heads=4, kv_heads=2, seed=3)
        runner = _runner(EngineConfig(model_path=str(folder), dtype="float32", max_total_tokens=256))
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        ids = [5, 17, 400, 9000, 12, 77, 3]
        logits, _, _ = runner.forward(
            ForwardPlan(1, ids, [(0, len(ids), list(range(runner.num_blocks)))], list(range(len(ids))))
        )
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        rel = ((logits - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-3, f"{arch}: relative error {rel}"
