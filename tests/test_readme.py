"""The README's first page tells the truth: its two set-up commands, the iteration it shows, the docs
it lists. These read files only (no torch, no services)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _setup_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block and README.index(block.group(0)) < README.index("\n## "), "README must open with its set-up commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_setup_commands_the_run_first():
    run, test = _setup_commands()
    assert run.startswith("python3 -m venv .venv") and run.endswith("pyflyte run workflows/rlvr.py rlvr")
    assert len(test) <= 80, f"the test command should be a short script call, not {len(test)} characters"


def test_ci_runs_the_readme_test_command():
    _, test = _setup_commands()
    script = test.split()[-1]
    assert (REPO / script).is_file(), script
    ci = (REPO / ".ci/run").read_text()
    assert script in ci, f".ci/run does not call {script}"


def test_iteration_snippet_matches_the_workflow():
    section = README[README.index("## How an iteration reads"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    workflow = (REPO / "tasks/loop/recipe.py").read_text()   # one_iteration: the body of workflows/rlvr.py's rl_iteration
    squash = lambda s: re.sub(r"\s+", " ", s.split("#")[0]).strip()  # noqa: E731
    lines = {squash(line) for line in workflow.splitlines()}
    for line in snippet.splitlines():
        if line.strip():
            assert squash(line) in lines, f"README line not in tasks/loop/recipe.py: {line!r}"


def test_every_doc_is_listed_in_the_layout():
    layout = README[README.index("## Layout"):]
    docs_line = layout[layout.index("docs/"):layout.index("```", layout.index("docs/"))]
    listed = set(re.findall(r"[\w-]+\.md", docs_line))
    present = {p.name for p in (REPO / "docs").glob("*.md")}
    assert listed == present, f"missing: {sorted(present - listed)}, not there: {sorted(listed - present)}"


def test_no_placeholders_left():
    assert not re.search(r"\b[A-Z]+_MEASURED\b", README)
