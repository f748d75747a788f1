"""`eaglegate train-draft` runs end to end on a tiny budget and produces a head the engine serves losslessly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime.engine import Engine
from worker.config import EngineConfig, SpecConfig
from worker.sampling import SamplingParams


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_train_draft_tiny_budget_end_to_end(tmp_path, smol_engine, kind):
    out = tmp_path / "head"
    cmd = [sys.executable, "-m", "server", "train-draft", "--kind", kind, "--out", str(out), "--prompts", "builtin",
           "--num-prompts", "8", "--max-new-tokens", "24", "--max-len", "96", "--epochs", "2", "--batch-size", "4",
           "--draft-vocab", "2048", "--checkpoint-every", "2", "--dtype", "float32"]
    if kind == "eagle3":
        # the path of scripts/device-train.sh: examples exported as token ids, then trained from that file; and
        # the bfloat16-autocast training path (weights stay float32)
        examples = tmp_path / "examples.pt"
        r = subprocess.run(cmd + ["--export-examples", str(examples)], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0 and examples.exists() and not (out / "data.pt").exists(), r.stderr[-2000:]
        cmd += ["--bf16-autocast", "--examples", str(examples)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "held-out expected accept length" in r.stdout
    config = json.loads((out / "config.json").read_text())
    facts = config["training"]
    assert facts["steps"] == 4 and config["draft_vocab_size"] == 2048 and config["eagle_kind"] == kind
    assert (out / "model.safetensors").exists() and "Reproduce:" in (out / "README.md").read_text()
    curve = json.loads((out / "curve.json").read_text())  # held-out accept length at each checkpoint
    assert [c["step"] for c in curve] == [2, 4] and all(c["heldout_tau"] >= 1.0 for c in curve)
    # resumable: a second run with the checkpoint in place does no new steps and keeps the result
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r2.returncode == 0 and "resumed from step 4" in r2.stdout
    prompt = smol_engine.encode("The quick brown fox")
    params = SamplingParams(max_new_tokens=16, temperature=0)
    ref = smol_engine.generate([prompt], params)[0].token_ids
    spec = SpecConfig("EAGLE", str(out), num_steps=3, eagle_topk=2, num_draft_tokens=6)
    with Engine(EngineConfig(dtype="float32", max_total_tokens=2048, spec=spec)) as eng:
        assert eng.generate([prompt], params)[0].token_ids == ref
