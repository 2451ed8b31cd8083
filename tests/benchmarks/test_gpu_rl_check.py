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

REPO = Path(__file__).resolve().parents[2]
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


# --- benchmarks/gpu_rl_check.py: the engine-level RL check ----------------------------------------

GPU_BOX_LACKS = "flytekit,flytekitplugins,ray,mlflow,pydantic,vllm,deepspeed"  # what the lent GPU machine has not installed
RL_CHECK = REPO / "benchmarks/gpu_rl_check.py"


def _hidden_python(tmp_path, hidden: str = GPU_BOX_LACKS) -> str:
    """An interpreter (a wrapper script) that runs like this one with `hidden` packages absent."""
    wrapper = tmp_path / "python-without"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO / "tests/support/hidden_packages.py"}" {hidden} -- "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_rl_check_smoke_on_cpu_runs_every_phase_without_the_orchestration_packages(tmp_path):
    """`--smoke --device cpu`, with flytekit, ray, mlflow, pydantic, vllm and deepspeed absent (the GPU
    box's set): every phase runs and writes its JSON; the checks it reports hold (~1 min at 1 thread)."""
    out = tmp_path / "out"
    proc = subprocess.run([_hidden_python(tmp_path), str(RL_CHECK), "--smoke", "--device", "cpu", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "FLYROLL_MAX_TORCH_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    summary = json.loads((out / "gpu_rl_check.json").read_text())
    phases = summary["phases"]
    assert list(phases) == ["env", "learn", "mfu", "gen", "rl_step", "sync", "strategies", "lora"]
    for name, p in phases.items():
        assert "result" in p, (name, p)
        assert json.loads((out / f"{name}.json").read_text()) == p
    env = phases["env"]["result"]
    assert env["versions"]["flytekit"] == env["versions"]["pydantic"] == "absent"
    assert env["placement_auto"]["worker with 1 GPU"] == ["cuda", "bfloat16"]
    learn = phases["learn"]["result"]
    assert learn["iterations_run"] == 2 and len(learn["curve"]) == 3
    assert learn["dtypes"] == {"trainer": "torch.float32", "generator": "torch.bfloat16", "reference": "torch.bfloat16",
                               "old_policy": "torch.bfloat16"}
    assert learn["generator_minus_bf16_trainer"] == 0.0
    mfu = phases["mfu"]["result"]
    assert not mfu["failed"] and len(mfu["rows"]) == 2 and all(r["adam_state_dtype"] == "torch.float32" for r in mfu["rows"])
    assert all("skipped" in r for r in mfu["skipped"])  # the compiled rows: not on cpu in --smoke
    gen = phases["gen"]["result"]
    assert not gen["failed"] and all(r["tokens_per_s"] > 0 and r["dtype"] == "torch.bfloat16" for r in gen["rows"])
    step = phases["rl_step"]["result"]
    assert step["dtypes_ok"] and step["generator_minus_bf16_trainer_after_sync"] == 0.0
    assert set(step["stages"]) == {"rollout_s", "old_and_ref_logprobs_s", "update_s", "sync_s"}
    assert step["logprob_gap"]["behaviour_vs_bf16_recompute"]["max_abs"] < 0.1
    sync = phases["sync"]["result"]
    assert sync["in_memory_max_diff"] == sync["from_checkpoint_max_diff"] == 0.0
    rows = phases["strategies"]["result"]["rows"]
    assert phases["strategies"]["result"]["backend"] == "gloo" and not phases["strategies"]["result"]["failed"]
    assert rows["ddp"]["update_rel_diff_vs_torch"] < 1e-4 and rows["fsdp2"]["update_rel_diff_vs_torch"] < 1e-4
    assert rows["fsdp2_bf16_params"]["update_rel_diff_vs_torch"] < 0.5  # bf16 gathered weights: close, not equal
    assert all(r["master_dtype"] == ["torch.float32"] for r in rows.values())
    assert phases["lora"]["result"]["ok"]


def test_rl_check_phases_subset_budget_and_arguments(tmp_path):
    """--phases reruns a subset; a phase that does not fit the budget is skipped, not failed; unknown
    phases and cuda without a GPU are refused."""
    run = lambda *a: subprocess.run([sys.executable, str(RL_CHECK), "--smoke", "--device", "cpu", "--out", str(tmp_path), *a],  # noqa: E731
                                    cwd=REPO, capture_output=True, text=True, timeout=300,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "FLYROLL_MAX_TORCH_THREADS": "1"})
    proc = run("--phases", "env,sync,learn", "--budget", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = json.loads((tmp_path / "gpu_rl_check.json").read_text())["phases"]
    assert list(phases) == ["env", "sync", "learn"]
    assert "result" in phases["env"] and "skipped" in phases["learn"]
    proc = run("--phases", "env,nope")
    assert proc.returncode == 2 and "unknown ['nope']" in proc.stderr
    import torch

    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(RL_CHECK), "--device", "cuda", "--out", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr


def test_rl_check_settings_are_the_default_presets():
    """The script's plain algorithm values and preset numbers are configs/tiny.yaml's, as loaded by the
    config schema (which the GPU box cannot import): a changed default fails here."""
    from benchmarks.engine_settings import ALGORITHM, PRESET, algorithm
    from configs.schema import load_config

    cfg = load_config(str(REPO / "configs/tiny.yaml"))
    assert cfg.algorithm.model_dump() == ALGORITHM
    assert vars(algorithm()) == ALGORITHM
    b = cfg.model.bootstrap
    assert PRESET["bootstrap"] == {k: getattr(b, k) for k in PRESET["bootstrap"]}
    assert PRESET["rollout"] == {k: getattr(cfg.rollout, k) for k in PRESET["rollout"]}
    assert PRESET["training"] == {k: getattr(cfg.training, k) for k in PRESET["training"]}
    assert PRESET["loop"] == {k: getattr(cfg.loop, k) for k in PRESET["loop"]}
    assert PRESET["eval_size"] == cfg.data.eval_size and PRESET["seed"] == cfg.run.seed


def test_pretrain_moves_each_batch_to_the_models_device(tiny_policy, monkeypatch):
    """engines/training/pretrain.py builds its batches on CPU and hands each to the model's device (a CUDA model
    failed with a device mismatch before): here every batch goes through TokenBatch.to(model device)."""
    import copy

    import torch

    from engines.models.batching import TokenBatch
    from engines.training.pretrain import supervised_finetune

    model, tok = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    seen, to = [], TokenBatch.to
    monkeypatch.setattr(TokenBatch, "to", lambda self, device: seen.append(torch.device(device)) or to(self, device))
    m = supervised_finetune(model, tok, [("1+2=", "3"), ("rev ab=", "ba")], steps=3, batch_size=2)
    assert seen == [next(model.parameters()).device] * 3 and m["bootstrap/steps"] == 3.0


def test_gpu_check_degrades_without_the_workflow_packages(tmp_path):
    """Without flytekit, ray, mlflow and pydantic, gpu_check.sh no longer exits: the steps that need
    them are skipped with the reason, and the run (here with a budget that skips every timed step)
    still writes its summary."""
    proc = _run("--device", "cpu", "--out", str(tmp_path), timeout=300,
                env={"FLYROLL_PYTHON": _hidden_python(tmp_path, "flytekit,flytekitplugins,ray,mlflow,pydantic"),
                     "FLYROLL_GPU_CHECK_BUDGET_S": "3", "FLYROLL_VLLM_PYTHON": str(tmp_path / "no-vllm")})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert "flytekit" in steps["placement"]["skipped"] and "pydantic" in steps["placement"]["skipped"]
    assert "flytekit" in steps["pyflyte"]["skipped"]
    assert steps["rl_check"]["skipped"] == "budget spent"  # it is the first step; the tiny budget skips it
