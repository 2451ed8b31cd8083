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
