"""The algorithm presets in configs/: each validates, shares the tiny bootstrapped base, is headed by the
command that runs it, and (slow tier) runs end to end through `pyflyte run` and raises eval accuracy.

The slow runs share one temp HOME / output folder / artifact store (`tiny_base_dir`, tests/conftest.py,
shared with tests/e2e/test_learning.py's default preset), so the base policy is bootstrapped once (by the
first run) and reused by the others through the store; each preset runs ITERATIONS iterations and its
eval/accuracy is read back from MLflow.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.support.workflow import PYFLYTE, REPO, _env

PRESETS = ("grpo", "dr_grpo", "reinforce_pp", "rloo", "dapo", "gspo", "ppo")
ITERATIONS = 10


@pytest.mark.parametrize("name", PRESETS)
def test_preset_validates_and_shares_the_tiny_base(name):
    from configs.schema import load_config

    path = REPO / "configs" / f"{name}.yaml"
    cfg, tiny = load_config(path), load_config(REPO / "configs/tiny.yaml")
    head = path.read_text().splitlines()[:3]
    assert head[0].startswith("#") and any(
        line.startswith("#") and f"pyflyte run workflows/rlvr.py rlvr --config configs/{name}.yaml" in line for line in head)
    assert cfg.model == tiny.model and cfg.run.seed == tiny.run.seed and cfg.run.torch_threads == tiny.run.torch_threads
    assert cfg.run.output_dir == tiny.run.output_dir and cfg.rollout == tiny.rollout and cfg.data == tiny.data
    assert cfg.run.name == name


@pytest.fixture(scope="module")
def shared_dir(tiny_base_dir):
    return tiny_base_dir


def _accuracy(tmp, name: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("flyroll").experiment_id])
    (run,) = [r for r in runs if r.data.params.get("run.name") == name and "mlflow.parentRunId" not in r.data.tags]
    return c, run, sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, "eval/accuracy"))


# `grpo` is left out: it is the default preset's algorithm (configs/tiny.yaml, whose learning
# tests/e2e/test_learning.py checks over 20 iterations, nightly). CI's slow tier keeps the preset with the
# most distinct path through the step -- ppo (critic, GAE) -- and runs the others nightly: rloo
# (leave-one-out baseline) and dapo (dynamic sampling, token-mean loss) since 2026-12-05, when .ci/run
# took 86 min on this box (limit 90, budget 45; ~200 s each there, plus the tiny base's bootstrap for
# the first one), and dr_grpo, reinforce_pp, gspo, which differ only in the advantage or loss formula.
# Their math is checked step by step in tests/test_algorithms*.py; DAPO's refills run through Ray in
# tests/tasks/loop/test_prompts_refill.py and dynamic sampling end to end in tests/e2e/test_agentic_workflow.py
NIGHTLY_ONLY = ("rloo", "dapo", "dr_grpo", "reinforce_pp", "gspo")
LEARNING_RUNS = tuple(pytest.param(p, marks=pytest.mark.nightly) if p in NIGHTLY_ONLY else p
                      for p in PRESETS if p != "grpo")


# nightly since 2026-12-04 (~100 s): CI's slow tier runs the per-task path in tests/e2e/test_workflow.py (the
# same run as the shared instance), tests/e2e/test_resume.py and tests/e2e/test_agentic_workflow.py (with dynamic
# sampling), and DAPO's refills in the rollout task through Ray in tests/tasks/loop/test_prompts_refill.py
@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(1800)  # it may bootstrap the shared base (see below)
def test_dapo_preset_runs_with_a_ray_cluster_per_task(shared_dir):
    """FLYROLL_RAY=per-task (the path a Flyte cluster runs), one iteration of the DAPO preset: its
    rollout task hosts the generation actors and the reward workers, with the reservations they make
    on a cluster, and they must fit that task's own Ray cluster (a misfit would wait for ever)."""
    cfg = yaml.safe_load((REPO / "configs" / "dapo.yaml").read_text())
    cfg["run"].update(output_dir=str(shared_dir / "runs"), name="dapo-per-task")
    cfg["loop"].update(iterations=1, eval_every=1)
    config = shared_dir / "dapo-per-task.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(config)],
                          cwd=shared_dir, env={**_env(shared_dir), "FLYROLL_RAY": "per-task"}, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    c, run, acc = _accuracy(shared_dir, "dapo-per-task")
    assert [s for s, _ in acc] == [0, 1]
    for key in ("dynamic_sampling/kept_groups", "timing/rollout_ray_start_s", "timing/training_ray_start_s"):
        assert [m.step for m in c.get_metric_history(run.info.run_id, key)] == [1], key
    assert "ray per-task: rollout cluster" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first preset also bootstraps the base (90 s on an idle box, 12 min on a busy one)
@pytest.mark.parametrize("name", LEARNING_RUNS)
def test_preset_raises_eval_accuracy_end_to_end(shared_dir, name):
    cfg = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    cfg["run"]["output_dir"] = str(shared_dir / "runs")
    cfg["loop"].update(iterations=ITERATIONS, eval_every=ITERATIONS // 2)
    config = shared_dir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(config)],
                          cwd=shared_dir, env=_env(shared_dir), capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    c, run, acc = _accuracy(shared_dir, name)
    assert acc[0][0] == 0 and acc[-1][0] == ITERATIONS, acc
    print(f"{name}: eval/accuracy {acc[0][1]:.3f} (iteration 0) -> {acc[-1][1]:.3f} (iteration {ITERATIONS})")
    assert acc[-1][1] > acc[0][1], acc
    history = lambda key: c.get_metric_history(run.info.run_id, key)  # noqa: E731
    if name == "ppo":
        assert len(history("critic/vf_loss")) == ITERATIONS
    if name == "dapo":
        assert len(history("dynamic_sampling/kept_groups")) == ITERATIONS
        assert len(history("dynamic_sampling/generation_rounds")) == ITERATIONS
