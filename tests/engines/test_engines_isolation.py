"""The engine layer runs where only torch, transformers, peft and safetensors are installed (a lent
GPU box): every `engines/` module imports with flytekit, ray and mlflow absent, and every one but the
prompt-table validation (pydantic) with pydantic absent too. Each check runs in a fresh interpreter
with those packages hidden (tests/support/hidden_packages.py), walking the package, so a new module is
covered without being listed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ORCHESTRATION = ("flytekit", "flytekitplugins", "ray", "mlflow")
# modules that may need a hidden package, with the reason (none may need flytekit, ray or mlflow)
NEEDS_PYDANTIC = {"engines.data.datasets": "validates user prompt tables with pydantic (PromptRow)",
                  "engines.data.sources": "builds its tables through engines.data.datasets",
                  "engines.data.tuning_rows": "validates user demonstration and preference tables with pydantic",
                  "engines.algorithms.config": "the algorithm config section is a pydantic model (the update path "
                                               "imports it for annotations only)",
                  "engines.rewards.config": "the reward config section is a pydantic model (the scoring path imports "
                                            "it for annotations only)"}

_WALK = r"""
import importlib, json, pkgutil, sys
sys.path.insert(0, {repo!r})
from tests.support.hidden_packages import hide
before = set(sys.modules)
hide({hidden!r})
import engines
failed = {{}}
for m in pkgutil.walk_packages(engines.__path__, "engines."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed[m.name] = f"{{type(e).__name__}}: {{e}}"
leaked = sorted(m for m in set(sys.modules) - before if m.partition(".")[0] in {hidden!r})
print(json.dumps({{"failed": failed, "leaked": leaked, "files": sorted({{getattr(sys.modules[m], "__file__", "") or "" for m in sys.modules if m.startswith("engines")}})}}))
"""


def _walk(hidden: tuple[str, ...]) -> dict:
    proc = subprocess.run([sys.executable, "-c", _WALK.format(repo=str(REPO), hidden=list(hidden))], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_engine_module_imports_without_flytekit_ray_or_mlflow():
    out = _walk(ORCHESTRATION)
    assert out["failed"] == {}, out["failed"]
    assert out["leaked"] == []
    assert all(f.startswith(str(REPO)) for f in out["files"] if f), "imported another checkout's engines/"


def test_engine_modules_but_prompt_validation_import_without_pydantic():
    """What benchmarks/gpu_rl_check.py needs (training, rl_step, generation, pretrain, lora,
    strategies, the algorithm registry) imports on a box without pydantic."""
    out = _walk(ORCHESTRATION + ("pydantic",))
    assert set(out["failed"]) == set(NEEDS_PYDANTIC), out["failed"]
    assert all("pydantic" in v for v in out["failed"].values()), out["failed"]
