"""The README's benchmark tables and flag table come from the code and the committed results, and result files follow
the naming rule."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from devtools.provenance import RESULT_NAME  # the rule the benchmarks write by
from server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def test_readme_benchmark_tables_match_bench_results():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_tables.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    readme = (ROOT / "README.md").read_text()
    # the headline tables: speculation, and each CPU kernel against llama.cpp's own server on some machine class
    for name in ("spec", "llama_server"):
        shown = re.findall(rf"<!-- bench:({name}(?:-[a-z0-9]+)?) -->", readme)
        assert shown and all((RESULTS / f"{n}.json").exists() for n in shown), name


def test_every_result_records_its_command_and_commit():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert data.get("command", "").startswith("python") and len(data.get("commit", "")) >= 7, path.name


def result_name_problems(names: list[str], benchmarks: set[str]) -> list[str]:
    """Names outside `<benchmark>[-<machine class>].<json|png>`, the benchmark being a script in bench/."""
    return [n for n in names if not ((m := RESULT_NAME.fullmatch(n)) and m["benchmark"] in benchmarks)]


def test_result_files_are_named_by_benchmark_and_machine_class():
    benchmarks = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert result_name_problems(sorted(p.name for p in RESULTS.iterdir()), benchmarks) == []
    # the rule itself rejects history-named files
    bad = ["spec_epyc_s28.json", "spec_2a8f790.json", "spec-stage3.json", "vnni.json", "spec-epyc.txt"]
    assert result_name_problems(bad + ["spec-epyc.json", "spec.png"], {"spec"}) == bad


def flags_in_readme(readme: str) -> set[str]:
    """Flags named in the first cell of the README's flag table rows (`| `--flag ...` | meaning |`)."""
    cells = re.findall(r"^\| `(--[^|]*)\|", readme, re.M)
    return {f for cell in cells for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cell)}


def serve_flags() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {s for a in serve._actions for s in a.option_strings if s.startswith("--")}


def test_the_readme_flag_table_and_the_cli_name_the_same_flags():
    named = flags_in_readme((ROOT / "README.md").read_text())
    assert len(named) >= 10, "the README's flag table is missing"
    assert named - serve_flags() == set()  # no flag the CLI lacks
    assert {f for f in serve_flags() - named if not f.startswith("--debug-")} == {"--help"}  # none left out
    assert flags_in_readme("| `--no-such-flag N` | x |\n") - serve_flags() == {"--no-such-flag"}
