"""benchmarks/gpu_check.sh, the GPU check of the per-role device/dtype path: its syntax and argument
checks on every run, and (slow tier) the whole script with `--device cpu`, where each step runs
shrunk on CPU and the workflow runs with three roles in bfloat16 on CPU. The `--device cuda` run
needs a GPU and is not part of the test suite; it prints numbers and asserts nothing on speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks/gpu_check.sh"


def _run(*args: str, timeout: int = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "FLYROLL_PYTHON": sys.executable, **(env or {})})


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_bad_arguments_are_refused_with_what_was_expected():
    proc = _run("--device", "tpu")
    assert proc.returncode == 2 and "--device 'tpu': expected cuda or cpu" in proc.stderr
    proc = _run("--iterations", "3")
    assert proc.returncode == 2 and "unknown argument '--iterations'" in proc.stderr


def test_cuda_without_a_gpu_says_to_use_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = _run("--device", "cuda")
    assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr and "--device cpu" in proc.stderr


@pytest.mark.nightly  # ~4 min on 2 cores: the whole script shrunk, kept out of every CI run (pytest -m nightly)
def test_cpu_run_exercises_every_step(tmp_path):
    """~3-4 min on 2 cores: the MFU smoke (mixed precision), the HF generation timing and weight sync,
    and a 1-iteration pyflyte run with actor_train, actor_infer and reference in bfloat16 on CPU."""
    proc = _run("--device", "cpu", "--out", str(tmp_path), timeout=900,
                env={"FLYROLL_VLLM_PYTHON": str(tmp_path / "no-vllm")})  # the vLLM step is not part of this test
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out["device"] == "cpu"
    steps = out["steps"]
    assert all(steps[s]["rc"] == 0 for s in ("mfu_mixed", "gen_hf", "pyflyte")), steps
    assert "skipped" in steps["gen_vllm"] and "skipped" in steps["mfu_bf16"]
    roles = out["placement"]["roles"]
    assert roles["actor_train"] == roles["actor_infer"] == roles["reference"] == ["cpu", "bfloat16"]
    assert out["mfu_mixed"]["precision"] == "torch.float32 weights, torch.bfloat16 autocast" and not out["mfu_mixed"]["failed"]
    assert out["gen_hf"]["tokens_per_s"] > 0 and out["gen_hf"]["weight_sync"]["from_checkpoint_s"] >= 0
    m = out["pyflyte_metrics"]
    assert len(m["timing/training_s"]) == 1 and len(m["timing/weight_sync_s"]) == 1  # one iteration ran every stage
