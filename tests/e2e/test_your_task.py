"""docs/your-task.md walked end to end with the walkthrough's own files (docs/your-task/): the JSONL
without domains, the reward module found from the working directory, a saved model folder, `pyflyte
run` with a `--set` override; then the split sizes the run trained and evaluated on, the reward that
scored it, and `flyroll eval` of the final policy on the run's eval split."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.support.workflow import PYFLYTE, REPO, _env

WALKTHROUGH = REPO / "docs/your-task"


def test_the_walkthrough_files_are_the_ones_the_doc_shows():
    doc = (REPO / "docs/your-task.md").read_text()
    for name in ("config.yaml", "my_reward.py"):
        body = (WALKTHROUGH / name).read_text().strip()
        assert body in doc, f"docs/your-task.md does not show docs/your-task/{name} as it is"
    rows = [json.loads(line) for line in (WALKTHROUGH / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 200 and all(set(r) == {"prompt", "answer"} for r in rows)   # no domain: the source gives it
    assert len({r["prompt"] for r in rows}) == 200


def test_the_reward_gives_partial_credit():
    sys.path.insert(0, str(WALKTHROUGH))
    try:
        from my_reward import close_enough
    finally:
        sys.path.remove(str(WALKTHROUGH))
    assert close_enough(" 420", {"answer": "420"}) == 1.0
    assert close_enough(" 400 min", {"answer": "420"}) == 0.5
    assert close_enough(" 42", {"answer": "420"}) == 0.0 and close_enough(" none", {"answer": "420"}) == 0.0


@pytest.mark.slow
def test_the_walkthrough_runs_end_to_end(tmp_path):
    from mlflow.tracking import MlflowClient

    from engines.data.prompt_mix import hash_split
    from engines.data.datasets import load_prompts
    from infra.store import ArtifactStore

    work = tmp_path / "my-task"
    shutil.copytree(WALKTHROUGH, work)
    env = {**_env(tmp_path), "PYTHONPATH": str(REPO)}
    saved = subprocess.run([sys.executable, "save_model.py", "my-model"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr[-3000:]
    run = subprocess.run([PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", "config.yaml",
                          "--set", '["run.torch_threads=1"]'], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "overrides: run.torch_threads=1" in out or "run.torch_threads=1" in out

    # the intended splits: the file's rows, eval ones chosen by prompt hash (about eval_size, at most 20 %)
    rows = load_prompts(str(work / "prompts.jsonl"), default_domain="counting").table
    split = hash_split(rows, 24, min_train=8, what="prompts.jsonl")
    store = ArtifactStore(str(work / "runs" / "store"))
    (train_key,) = [k for k in store.list("datasets") if k.endswith("/train")]
    train_rows, eval_rows = store.manifest(train_key).metadata["rows"], store.manifest(train_key[:-5] + "eval").metadata["rows"]
    assert (train_rows, eval_rows) == (len(split.train), len(split.evals)) and train_rows + eval_rows == 200
    assert 12 <= eval_rows <= 40, eval_rows
    assert f"{train_rows} train / {eval_rows} eval prompts" in out

    c = MlflowClient(tracking_uri=f"sqlite:///{work / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("flyroll")
    (parent,) = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert parent.data.params["reward.functions.counting"] == "my_reward:close_enough"
    assert [m.step for m in c.get_metric_history(parent.info.run_id, "eval/accuracy/counting")] == [0, 2]
    assert [m.step for m in c.get_metric_history(parent.info.run_id, "reward/errors")] == [1, 2]
    assert all(m.value == 0 for m in c.get_metric_history(parent.info.run_id, "reward/errors"))  # the reward was imported and ran
    assert c.get_metric_history(parent.info.run_id, "data/train_rows")[0].value == train_rows

    (policy,) = [k for k in store.list("runs") if k.endswith("/policy/v0002")]
    ev = subprocess.run([sys.executable, "-c", "import sys; from infra.cli import main; sys.exit(main())", "eval",
                         "--store", str(work / "runs" / "store"), "--model", policy,
                         "--data", str(work / "runs" / "store" / train_key[:-5] / "eval" / "eval.parquet"),
                         "--config", "config.yaml"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["n"] == eval_rows and 0.0 <= result["accuracy/counting"] <= 1.0
