"""A rerun refused because the finished run's final policy is corrupt leaves its MLflow run as it was
(issue 60). Before, `prepare_run` reopened the FINISHED run (RUNNING, owner tags, `flyroll.reopened_from`,
`flyte.execution_id.resumed`), `resume_point` then refused the corrupt version, and the process's exit
ended the run FAILED while its `flyroll.status` tag still said complete."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.datasets import _config
from tests.support.workflow import REPO, _env

# the workflow's first tasks, in its order (workflows/rlvr.py), in a process of their own: its exit
# ends the MLflow runs it owns, as a local `pyflyte run`'s does
RERUN = textwrap.dedent("""
    import sys
    from tasks.stages.prepare import build_base_policy, prepare_run, resume_point
    spec, model_spec = prepare_run(config=sys.argv[1], restart=False)
    resume_point(spec=spec, base=build_base_policy(model_spec), model_spec=model_spec)
""")


def _flip_byte(path, offset: int) -> None:
    """Corrupt one byte in place, as a bad disk or a stray write would (size unchanged)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_refused_rerun_leaves_the_finished_mlflow_run_as_it_was(tmp_path, tiny_model_dir, monkeypatch):
    from infra import tracking
    from infra.store import ArtifactStore
    from tasks.stages.prepare import build_base_policy, prepare_run

    env = {**_env(tmp_path), "COLUMNS": "4000"}  # flytekit prints the error in a rich panel: one line
    monkeypatch.setenv("FLYROLL_CACHE_DIR", env["FLYROLL_CACHE_DIR"])
    config = _config(tmp_path, path=tiny_model_dir)
    spec, model_spec = prepare_run(config=config, restart=False)
    base = build_base_policy(model_spec)
    store = ArtifactStore(spec.store_uri)
    final = f"runs/{spec.run_id}/policy/v0001"
    store.publish(tiny_model_dir, final, kind="checkpoint", producer="weight_sync", parents=[base.key])
    # the end of the run, as finalize writes it
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.final_policy": final, "flyroll.status": "complete"})
    tracking.end_run(spec.tracking_uri, spec.mlflow_run_id)
    store.unlock_run(spec.run_id)
    before = tracking.client(spec.tracking_uri).get_run(spec.mlflow_run_id)
    assert before.info.status == "FINISHED"

    _flip_byte(f"{spec.store_uri}/{final}/model.safetensors", offset=4096)
    rerun = subprocess.run([sys.executable, "-c", RERUN, config], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode != 0, rerun.stdout[-3000:]
    after = tracking.client(spec.tracking_uri).get_run(spec.mlflow_run_id)
    assert (after.info.status, after.data.tags.get(tracking.END_REASON)) == ("FINISHED", None)
    assert after.info.end_time == before.info.end_time
    assert after.data.tags == before.data.tags
    assert f"run {spec.run_id!r} is not resumed: its newest policy version {final} is corrupt" in rerun.stderr, rerun.stderr[-3000:]
    assert "model.safetensors" in rerun.stderr and "MLflow run is left as it was" in rerun.stderr
