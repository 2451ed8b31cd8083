"""workflows/agentic.py through the real `pyflyte run` in a temp folder (tests/e2e/test_agentic_workflow.py,
tests/e2e/test_agentic_presets.py): the run and its MLflow metric histories."""

from __future__ import annotations

import subprocess

import yaml

from tests.support.workflow import PYFLYTE, REPO, _env, _mlflow


def _run(tmp_path, preset: str, ray_mode: str = "shared", timeout_s: int = 3000, **overrides):
    """`pyflyte run workflows/agentic.py agentic` on `preset` with `overrides` ({section: {field: value}}),
    killed after `timeout_s`; asserts it succeeded. Returns (MLflow client, the run, the config)."""
    proc, cfg = _launch(tmp_path, preset, ray_mode, timeout_s=timeout_s, **overrides)
    assert proc.returncode == 0, proc.stderr[-5000:]
    c, run = _mlflow(tmp_path)
    return c, run, cfg


def _launch(tmp_path, preset: str, ray_mode: str = "shared", timeout_s: int = 3000, **overrides):
    """The run of `_run`, unchecked: (the finished process, its output captured; the config)."""
    cfg = yaml.safe_load((REPO / preset).read_text())
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([PYFLYTE, "run", str(REPO / "workflows/agentic.py"), "agentic", "--config", str(path)],
                          cwd=tmp_path, env={**_env(tmp_path), "FLYROLL_RAY": ray_mode}, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    return proc, cfg


def _history(c, run, key):
    return sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, key))
