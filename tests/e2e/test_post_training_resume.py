"""SFT killed and rerun: SIGKILL a real `pyflyte run workflows/sft.py sft` (its process group, Ray included)
once its second version is published, then rerun the same command. The rerun resumes from v0002 and its
trainer state (optimizer moments, LR schedule, the rows each step draws), publishes only v0003, logs no
step twice, registers each version once, and ends with exactly the weights of an uninterrupted run of the
same config (one torch thread)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from configs.data.make_tiny_data import rows
from tests.support.processes import run_until_marker_then_kill
from tests.support.workflow import PYFLYTE, REPO, _env

# nightly: two SFT runs and a killed one (~3 min); CI's slow tier runs every post-training workflow once
# (tests/e2e/test_post_training_chain.py) and the RL kill-and-resume in tests/infra/test_tracking_run_status.py
pytestmark = [pytest.mark.slow, pytest.mark.nightly]


def _setup(tmp: Path) -> tuple[list[str], Path]:
    """The SFT config (e2e model and rewards, 3 versions of 2 steps, evaluation after each) and its command."""
    tmp.mkdir(parents=True, exist_ok=True)
    demos = tmp / "demos.jsonl"
    demos.write_text("".join(json.dumps(r) + "\n" for r in rows(48, 5, pairs=False)))
    e2e = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    cfg = {"run": {**e2e["run"], "output_dir": str(tmp / "runs"), "name": "sft-resume"}, "model": e2e["model"],
           "reward": e2e["reward"], "rollout": {"max_new_tokens": 6}, "training": {"lr": 1e-3},
           "sft": {"train_uri": str(demos), "eval_size": 8, "batch_size": 8, "steps": 6, "steps_per_version": 2,
                   "eval_every": 1}}
    path = tmp / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return [PYFLYTE, "run", str(REPO / "workflows/sft.py"), "sft", "--config", str(path)], path


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_sigkilled_sft_run_resumes_from_its_last_version_to_the_same_weights(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    from configs.schema import load_config

    cmd, config = _setup(tmp_path / "killed")
    cwd = tmp_path / "killed"
    cfg = load_config(config)
    run_id = f"{cfg.run.name}-{cfg.hash()}"
    policy = cwd / "runs" / "store" / "runs" / run_id / "policy"
    env = {**_env(cwd), "OMP_NUM_THREADS": "1", "FLYROLL_MAX_TORCH_THREADS": "1"}
    run_until_marker_then_kill(cmd, cwd, env, policy / "v0002" / "MANIFEST.json", cwd / "first.log")
    assert sorted(p.name for p in policy.iterdir() if (p / "MANIFEST.json").exists()) == ["v0001", "v0002"]

    rerun = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-6000:]
    assert "resuming run" in out and f"resume from runs/{run_id}/policy/v0002" in out
    versions = sorted(p.name for p in policy.iterdir() if (p / "MANIFEST.json").exists())
    assert versions == ["v0001", "v0002", "v0003"]
    v3 = json.loads((policy / "v0003" / "MANIFEST.json").read_text())
    assert v3["parents"] == [f"runs/{run_id}/policy/v0002"]

    c = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("flyroll")
    (run,) = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    for key in ("sft/steps_done", "sft/loss", "eval/loss"):
        assert sorted(m.step for m in c.get_metric_history(run.info.run_id, key)) == [1, 2, 3], key
    assert [m.value for m in sorted(c.get_metric_history(run.info.run_id, "sft/steps_done"), key=lambda m: m.step)] == [2, 4, 6]
    registered = [v for v in c.search_model_versions("name='flyroll-policy'") if v.tags.get("flyroll.run_id") == run_id]
    assert sorted(v.tags["flyroll.iteration"] for v in registered) == ["1", "2", "3"]

    # the same config, never interrupted, in a folder of its own: the same weights, bit for bit
    straight_cmd, straight_config = _setup(tmp_path / "straight")
    straight_cfg = load_config(straight_config)
    straight = subprocess.run(straight_cmd, cwd=tmp_path / "straight", env={**_env(tmp_path / "straight"), "OMP_NUM_THREADS": "1",
                                                                           "FLYROLL_MAX_TORCH_THREADS": "1"},
                              capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-6000:]
    other = tmp_path / "straight" / "runs" / "store" / "runs" / f"{straight_cfg.run.name}-{straight_cfg.hash()}" / "policy" / "v0003"
    resumed, uninterrupted = _weights(policy / "v0003"), _weights(other)
    assert resumed.keys() == uninterrupted.keys()
    assert all(bool((resumed[k] == uninterrupted[k]).all()) for k in resumed), \
        [k for k in resumed if not bool((resumed[k] == uninterrupted[k]).all())][:5]
    first = _weights(policy / "v0001")
    assert any(not bool((first[k] == resumed[k]).all()) for k in resumed)   # training moved them
