"""The workflow through the real `pyflyte` CLI in a temp folder (tests/e2e/test_workflow.py and the other
end-to-end tests): its environment, tests/configs/e2e.yaml with overrides, the run, its MLflow run.
The one e2e run of the session is the `e2e_run` fixture (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))


def _env(tmp: Path) -> dict:
    env = dict(os.environ)
    # TMPDIR inside the test folder: Flyte's and flyroll's scratch files go with it (and tests can look
    # at what a run leaves behind); Ray keeps its short /tmp/ray (unix socket paths are length-limited).
    env.update(HOME=str(tmp / "home"), FLYROLL_CACHE_DIR=str(tmp / "cache"), RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=str(REPO), MLFLOW_TRACKING_URI="", TMPDIR=str(tmp / "tmp"),
               RAY_TMPDIR=os.environ.get("RAY_TMPDIR", "/tmp"))
    env.pop("MLFLOW_TRACKING_URI")
    (tmp / "home").mkdir(exist_ok=True)
    (tmp / "tmp").mkdir(exist_ok=True)
    return env


def _config(tmp: Path, **sections) -> Path:
    cfg = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    cfg["run"]["output_dir"] = str(tmp / "runs")
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _pyflyte_run(tmp: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", *args], cwd=tmp, env=_env(tmp),
                          capture_output=True, text=True, timeout=timeout)


def _mlflow(tmp: Path):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("flyroll")
    (run,) = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    return c, run


def _retrain(tmp, config, iterations: int) -> subprocess.CompletedProcess:
    return subprocess.run([PYFLYTE, "run", str(REPO / "workflows/schedules.py"), "retrain", "--config", str(config),
                           "--iterations", str(iterations)], cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)


def _client(tmp):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")


def _retrain_run(c, after_ms: int):
    exp = c.get_experiment_by_name("flyroll")
    runs = [r for r in c.search_runs([exp.experiment_id], filter_string="tags.`flyroll.workflow` = 'retrain'")
            if r.info.start_time >= after_ms]
    (run,) = runs
    return run
