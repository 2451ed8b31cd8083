"""Slow tier: the README's default job learns. Runs `pyflyte run workflows/rlvr.py rlvr` on the default
preset (bootstrap included) in a temp folder and reads eval/accuracy back from MLflow."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.test_workflow import PYFLYTE, REPO, _env


@pytest.mark.slow
def test_default_preset_at_least_doubles_eval_accuracy(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(config)],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = [r for r in c.search_runs([c.get_experiment_by_name("flyroll").experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    acc = sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, "eval/accuracy"))
    assert acc[0][0] == 0 and acc[-1][0] == cfg["loop"]["iterations"]
    assert 0 < acc[0][1] and acc[-1][1] >= 2 * acc[0][1], acc
