"""The layout's rules: packages import without circles, one helper per job, result files named by rule."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "runtime", "worker", "speculative", "training")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every project module `name` imports anywhere in its file: at the top, inside functions, under TYPE_CHECKING."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from pkg import name` names a module, or a symbol of pkg
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_cycles() -> list[list[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def test_no_module_imports_itself_through_a_circle():
    assert import_cycles() == []


def test_the_cycle_finder_sees_a_function_local_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "server"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from server.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from server.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("server",))
    assert import_cycles() == [["server.a", "server.b", "server.a"]]


def test_one_free_port_helper_in_the_tree():
    defs = [
        p
        for pkg in (*PACKAGES, "tests", "bench", "scripts", "devtools")
        for p in (ROOT / pkg).rglob("*.py")
        if re.search(r"\.bind\(\(", p.read_text())
    ]
    assert [p.relative_to(ROOT).as_posix() for p in defs] == ["worker/dist.py"]


def test_the_harness_is_one_package_the_product_never_imports():
    """tests/, bench/ and scripts/ share code through `devtools`, never by editing sys.path; the serving packages do
    not depend on the harness."""
    harness = [p for d in ("tests", "bench", "scripts", "devtools") for p in (ROOT / d).rglob("*.py")]
    edits = re.compile(r"sys\.path\s*(\.insert|\.append|\[|\+=)")
    assert [p.relative_to(ROOT).as_posix() for p in harness if edits.search(p.read_text())] == []
    modules = _modules()
    users = [n for n, p in modules.items() if any(t.startswith("devtools") for t in _imports(n, p, {"devtools"}))]
    assert users == []


def test_the_tree_is_linted_and_formatted():
    """`make lint` as a test, so CI holds the tree to one formatter: ruff for Python, clang-format for the C++."""
    r = subprocess.run(["make", "-s", "lint"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"make lint (make fmt fixes formatting):\n{r.stdout}{r.stderr}"[-3000:]
