"""What the `flyroll bench` drivers share (benchmarks/bench.py: throughput, bench_pipeline.py: the
pipeline's stage breakdown, bench_learning.py: accuracy vs wall time): where the scripts are, TRL's
own environment, the box probe, and the numbers' formatting."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
TRL_REQUIREMENTS = ("torch==2.13.0", "trl==1.16.0")  # trl pulls transformers, accelerate, datasets
TRL_SYSTEM = "TRL 1.16 GRPOTrainer"


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, None when either is missing or the baseline is 0."""
    if value is None or not baseline:
        return None
    return value / baseline


def box_probe(threads: int, when: str) -> dict | None:
    """benchmarks/box_probe.py in a child process (compute rate, memory bandwidth, page-fault cost
    right now); its line is printed, its numbers returned (None when it failed: printed, not fatal)."""
    r = subprocess.run([sys.executable, str(BENCH_DIR / "box_probe.py"), "--threads", str(threads)],
                       capture_output=True, text=True, timeout=300)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        print(f"box probe ({when}) failed: {(r.stderr.strip().splitlines() or ['exit ' + str(r.returncode)])[-1]}", flush=True)
        return None
    print(f"box ({when}): {(r.stderr.strip().splitlines() or ['(the probe printed no summary line)'])[-1]}", flush=True)
    return json.loads(lines[-1])


def fmt(x, spec: str = ".1f", suffix: str = "") -> str:
    return "—" if x is None else format(x, spec) + suffix


def _version(python: Path, module: str) -> str | None:
    """`module.__version__` as `python` imports it, or None (the reason is printed)."""
    if not python.exists():
        return None
    r = subprocess.run([str(python), "-c", f"import {module}; print({module}.__version__)"], capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip().splitlines()[-1]
    print(f"{python}: `import {module}` failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
    return None


def ensure_trl_venv(venv: Path) -> Path:
    """TRL's own environment (python -m venv + pip install torch trl), created once; returns its python."""
    python = venv / "bin" / "python"
    if _version(python, "trl") == TRL_REQUIREMENTS[1].split("==")[1]:
        print(f"TRL environment: {venv} (trl {TRL_REQUIREMENTS[1].split('==')[1]}, reused)", flush=True)
        return python
    t0 = time.time()
    print(f"TRL environment: creating {venv} (python -m venv; pip install {' '.join(TRL_REQUIREMENTS)}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--progress-bar", "off", *TRL_REQUIREMENTS], check=True)
    found = _version(python, "trl")
    if found is None:
        raise RuntimeError(f"{venv}: `import trl` fails after installing {TRL_REQUIREMENTS}")
    print(f"TRL environment: {venv} ready in {time.time() - t0:.0f} s (trl {found})", flush=True)
    return python
