"""Rank forensics on the founding bug: tp=3 with rank 0's verify decisions not broadcast and noisy logits on ranks 1
and 2. Every rank writes its crash dump, `eaglegate replay` names the step and the field where the ranks parted,
and `/debug/ranks` shows the failed group's last steps apart."""

from __future__ import annotations

import subprocess
import sys

import httpx

from devtools.models import eagle_flags, save_copy_eagle_head, save_tiny_model
from devtools.server import ServerProcess
from worker.model.config import load_model_config
from worker.model.files import resolve_model

KEY = "sk-forensics"


def test_a_divergence_leaves_dumps_that_replay_names_and_ranks_shown_apart(tmp_path, smol_dir):
    # 6 heads over 3 KV heads: tp=3 gives each rank two heads and one KV head
    model = save_tiny_model(tmp_path / "m", "llama", heads=6, kv_heads=3, hidden=48, intermediate=96, seed=3)
    head = save_copy_eagle_head(tmp_path / "head", load_model_config(resolve_model(str(model))))  # drafts land
    dumps = tmp_path / "dumps"
    args = ["--model-path", str(model), "--tp-size", "3", "--dtype", "float32", "--max-total-tokens", "2048"]
    args += [*eagle_flags(head), "--debug-rank-logit-noise", "3.0", "--debug-skip-decision-broadcast"]
    s = ServerProcess([*args, "--crash-dump-folder", str(dumps), "--no-restart-workers"], api_key=KEY)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        live = httpx.get(s.base_url + "/debug/ranks", headers=auth, timeout=10).json()
        assert live["alive"] and [r["rank"] for r in live["ranks"]] == [0, 1, 2] and live["failed_group"] is None
        assert httpx.get(s.base_url + "/debug/ranks", timeout=10).status_code == 401  # behind the key
        body = {"model": str(model), "prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        r = httpx.post(s.base_url + "/v1/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 503 and "RankDivergenceError" in r.text, r.text

        # every rank's last steps, one folder for the group
        (group,) = dumps.iterdir()
        assert sorted(p.name for p in group.iterdir()) == ["rank0.json", "rank1.json", "rank2.json"]
        out = subprocess.run(
            [sys.executable, "-m", "server", "replay", str(group)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert all("RankDivergenceError" in line for line in lines[:3]), out.stdout
        assert not any("do not reproduce" in line for line in lines), out.stdout
        verdict = lines[-1]
        assert verdict.startswith("first divergence: step "), out.stdout
        assert any(f": {field} differs" in verdict for field in ("accepted", "seq_len", "bonus", "path")), verdict

        # the failed group's final heartbeats: each rank's last step, and their fingerprints apart
        ranks = httpx.get(s.base_url + "/debug/ranks", headers=auth, timeout=10).json()
        assert not ranks["alive"] and "RankDivergenceError" in ranks["last_failure"]
        failed = ranks["failed_group"]
        assert [r["rank"] for r in failed] == [0, 1, 2] and all(r["last_step"] > 0 for r in failed)
        assert len({(r["last_step"], r["fingerprint"]) for r in failed}) > 1, failed
        step = int(verdict.split("step ")[1].split(",")[0])
        assert all(r["last_step"] >= step for r in failed)
    finally:
        s.stop()
