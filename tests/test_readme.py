"""The README's benchmark tables are generated from the committed results, and every result says where it came from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_benchmark_tables_match_bench_results():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    readme = (ROOT / "README.md").read_text()
    for name in ("spec", "quant"):
        assert f"<!-- bench:{name} -->" in readme and (ROOT / "bench" / "results" / f"{name}.json").exists()


def test_every_result_records_its_command_and_commit():
    files = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert data.get("command", "").startswith("python") and len(data.get("commit", "")) >= 7, path.name
