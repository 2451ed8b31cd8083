"""The floors (docs/architecture.md): import-linter's contracts in `.importlinter` hold.

`workflows | benchmarks` > `tasks` > `infra` > `configs` > `engines`; no circle between siblings of
any package (imports inside functions count); stage tasks never import each other; engines/ and
configs/ import no flytekit, ray or mlflow."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_contracts_cover_every_package():
    ini = configparser.ConfigParser()
    ini.read(ROOT / ".importlinter")
    roots = set(ini["importlinter"]["root_packages"].split())
    assert roots == {"workflows", "benchmarks", "tasks", "infra", "configs", "engines"}
    types = {ini[s]["type"] for s in ini.sections() if s.startswith("importlinter:contract:")}
    assert {"layers", "forbidden", "acyclic_siblings"} <= types
    acyclic = ini["importlinter:contract:acyclic"]["ancestors"].split()
    assert set(acyclic) == roots


def _test_module_references(path: Path) -> list[str]:
    """The `test_*` modules that the file at `path` imports (at its head or inside a function; by
    dotted path under `tests`, from `tests`, bare, or relative) or names in a string by dotted path
    (a `module:function` reward route, a subprocess's import), each as `file:line: module`."""
    import ast
    import re

    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module or ''}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = re.findall(r"\btests\.(test_\w+)", node.value)
        else:
            continue
        for name in names:
            parts = name.split(".")
            hits = [p for p in parts if p.startswith("test_")]
            if parts[0] in ("", "tests", *hits) or len(parts) == 1:
                found += [(node.lineno, p) for p in hits]
    return [f"{path.relative_to(ROOT)}:{line}: {module}" for line, module in sorted(set(found))]


def test_no_test_file_imports_another_test_file():
    """Shared helpers live in tests/support/ (or fixtures in tests/conftest.py), where a reader looks
    for them: no test file imports from, or routes a reward to, another test file, and the support
    modules and conftest.py reach into none. A test file may name itself (a subprocess probe)."""
    tests = ROOT / "tests"
    bad = []
    for path in sorted(tests.rglob("*.py")):
        own = path.stem if path.name.startswith("test_") else None
        bad += [ref for ref in _test_module_references(path) if not ref.endswith(f": {own}")]
    assert not bad, "import shared helpers from tests/support/, not from a test file:\n" + "\n".join(bad)
