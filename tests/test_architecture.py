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


# --- Wings (docs/architecture.md): every module in a wing, one door per name, tests mirror the tree ---

SOURCE_FLOORS = ("engines", "tasks", "infra", "configs", "workflows", "benchmarks")
WINGED = {"engines": "engines-wings", "tasks": "tasks-wings"}   # floor -> its layers contract


def _layer_names(contract: str) -> set[str]:
    ini = configparser.ConfigParser()
    ini.read(ROOT / ".importlinter")
    names = set()
    for line in ini[f"importlinter:contract:{contract}"]["layers"].split("\n"):
        names |= {n.strip() for n in line.split("|") if n.strip()}
    return names


def test_every_wing_is_a_layer_and_no_module_sits_outside_a_wing():
    """engines/ and tasks/ hold wings (sub-packages) only, and each floor's `layers` contract names
    every wing, so a new wing cannot join without being ordered against the others."""
    for floor, contract in WINGED.items():
        loose = sorted(p.name for p in (ROOT / floor).glob("*.py") if p.name != "__init__.py")
        assert not loose, f"{floor}/ holds modules outside any wing: {loose} (put each in a wing folder)"
        wings = {p.name for p in (ROOT / floor).iterdir() if (p / "__init__.py").is_file()}
        assert wings == _layer_names(contract), (floor, sorted(wings ^ _layer_names(contract)))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_names(tree) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """(names a module defines, names it imports from another module: name -> (module, its name))."""
    import ast

    defined, imported = set(), {}
    for node in tree.body:
        body = [node] + (node.body + node.orelse if isinstance(node, (ast.If, ast.Try)) else [])
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                defined |= {x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                imported.update({a.asname or a.name: (n.module, a.name) for a in n.names})
    return defined, imported


def test_one_door_per_name():
    """A name is imported from the module that defines it, never through a module that only imports
    it (a re-export left behind by a move). Covers the source floors, the tests and their helpers."""
    import ast

    paths = [p for floor in (*SOURCE_FLOORS, "tests") for p in (ROOT / floor).rglob("*.py")]
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in paths}
    modules = {_module_name(p): _top_level_names(t) for p, t in trees.items()}
    bad = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module in modules and not node.level):
                continue
            defined, imported = modules[node.module]
            for alias in node.names:
                name = alias.name
                if name in defined or f"{node.module}.{name}" in modules:
                    continue  # defined there, or a sub-module
                source = imported.get(name)
                if source and source[0] in modules:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} from {node.module} (it lives in {source[0]})")
    assert not bad, "import each name from the module that defines it:\n" + "\n".join(bad)


def test_tests_mirror_the_tree():
    """tests/<floor>/... mirrors the source tree (tests/engines/<wing>/test_<module>.py and so on);
    end-to-end runs live in tests/e2e/, helpers in tests/support/, and only the checks of the whole
    repository (this file, the README's) sit at the top of tests/."""
    tests = ROOT / "tests"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == ["test_architecture.py", "test_readme.py"], top
    allowed = {*SOURCE_FLOORS, "e2e", "support"}
    for path in tests.rglob("test_*.py"):
        rel = path.relative_to(tests).parts
        if len(rel) == 1:
            continue
        assert rel[0] in allowed, f"tests/{'/'.join(rel)}: tests/{rel[0]}/ mirrors no floor"
        if rel[0] in WINGED and len(rel) > 2:
            assert (ROOT / rel[0] / rel[1] / "__init__.py").is_file(), f"tests/{'/'.join(rel)}: {rel[0]}/{rel[1]}/ is no wing"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "test file names must stay unique (pytest imports them by basename)"


def test_test_files_are_named_after_what_they_test():
    """tests/<floor>/<wing>/test_<module>[_<aspect>].py: a test file's name starts with a module or package
    of the folder it mirrors, or with that folder's own name when it tests the package as a whole."""
    tests, bad = ROOT / "tests", []
    for path in tests.rglob("test_*.py"):
        rel = path.relative_to(tests)
        if rel.parts[0] not in SOURCE_FLOORS:
            continue
        source = ROOT.joinpath(*rel.parts[:-1])
        own = {p.stem for p in source.glob("*.py")} | {p.name for p in source.iterdir() if p.is_dir()} | {source.name}
        stem = path.stem.removeprefix("test_")
        if not any(stem == n or stem.startswith(f"{n}_") for n in own):
            bad.append(str(path.relative_to(ROOT)))
    assert not bad, "name each test file after the module it tests (test_<module>[_<aspect>].py):\n" + "\n".join(bad)


SOURCE_LIMIT = 400
REASON = "# longer than 400 lines:"


def test_source_files_over_400_lines_say_why():
    """A source file is short enough to read in one sitting; one over 400 lines says why in a line
    starting with `# longer than 400 lines:` among its first 30 lines."""
    long = []
    for floor in SOURCE_FLOORS:
        for path in (ROOT / floor).rglob("*.py"):
            lines = path.read_text().splitlines()
            if len(lines) > SOURCE_LIMIT and not any(line.startswith(REASON) for line in lines[:30]):
                long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not long, f"split these, or give the reason at the top ({REASON} ...):\n" + "\n".join(long)


DATE = r"(\d{4}-\d{2}-\d{2}|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,4}\b)"


def test_reference_pages_are_short_and_undated():
    """docs/: a reference page (how it works, how to use it, its tests, current figures) stays under
    400 lines and has no dated heading; run diaries and dated results go to `*-log.md` pages (the
    rule verl's docs-date check keeps)."""
    import re

    bad = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.name.endswith("-log.md"):
            continue
        lines = page.read_text().splitlines()
        if len(lines) >= SOURCE_LIMIT:
            bad.append(f"{page.relative_to(ROOT)}: {len(lines)} lines")
        bad += [f"{page.relative_to(ROOT)}:{i}: dated heading {line!r}" for i, line in enumerate(lines, 1)
                if line.startswith("#") and re.search(DATE, line)]
    assert not bad, "move run diaries and dated results to a *-log.md page:\n" + "\n".join(bad)


def test_architecture_doc_lists_every_wing():
    doc = (ROOT / "docs/architecture.md").read_text()
    missing = [f"{floor}/{wing}/" for floor, contract in WINGED.items() for wing in sorted(_layer_names(contract))
               if f"{floor}/{wing}/" not in doc]
    assert not missing, f"docs/architecture.md does not name: {missing}"
