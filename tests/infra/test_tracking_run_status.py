"""Nothing left RUNNING in MLflow (infra/tracking.py): a failed process marks its runs FAILED, a
SIGTERMed one KILLED, a SIGKILLed one's runs are marked KILLED by the next run that finds them; and a
run SIGKILLed during weight sync, then resumed, ends with nothing RUNNING and no metric gap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.store_pause import store_pause_hook
from tests.support.workflow import PYFLYTE, REPO, _config, _env

OWNED_RUN = textwrap.dedent("""
    import os, sys, time
    from infra import tracking
    uri, how = sys.argv[1], sys.argv[2]
    run = tracking.start_parent_run(uri, "exp", "r", {}, {"flyroll.run_id": "r"})
    tracking.claim_run(uri, run, end_on_exit=how != "sigkill")
    child = tracking.iteration_run(uri, run, 1, end_on_exit=how != "sigkill")
    print(run, child, flush=True)
    if how == "raise":
        raise RuntimeError("a stage failed")
    time.sleep(60)
""")


def _owned(tmp_path: Path, how: str) -> tuple[str, list[str]]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.Popen([sys.executable, "-c", OWNED_RUN, uri, how], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ids = proc.stdout.readline().split()
    if how in ("sigterm", "sigkill"):
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    proc.wait(timeout=60)
    assert len(ids) == 2, proc.stderr.read()[-3000:]
    return uri, ids


def _statuses(uri: str, ids: list[str]) -> list[str]:
    from infra import tracking

    return [tracking.client(uri).get_run(i).info.status for i in ids]


def test_a_failing_process_marks_its_runs_failed(tmp_path):
    from infra import tracking

    uri, ids = _owned(tmp_path, "raise")
    assert _statuses(uri, ids) == ["FAILED", "FAILED"]
    assert tracking.client(uri).get_run(ids[1]).data.tags[tracking.END_REASON].startswith("FAILED: the process exited")


def test_a_sigtermed_process_marks_its_runs_killed(tmp_path):
    uri, ids = _owned(tmp_path, "sigterm")
    assert _statuses(uri, ids) == ["KILLED", "KILLED"]


def test_runs_of_a_sigkilled_process_are_ended_by_the_next_one_and_reopened_on_resume(tmp_path):
    from infra import tracking

    uri, ids = _owned(tmp_path, "sigkill")
    assert _statuses(uri, ids) == ["RUNNING", "RUNNING"]
    live = tracking.start_parent_run(uri, "exp", "other", {}, {"flyroll.run_id": "other"})
    tracking.claim_run(uri, live, end_on_exit=False)  # owned by this live process: left alone
    assert sorted(tracking.end_orphaned_runs(uri, "exp")) == sorted(ids)
    assert _statuses(uri, [*ids, live]) == ["KILLED", "KILLED", "RUNNING"]
    assert "is gone without ending it" in tracking.client(uri).get_run(ids[0]).data.tags[tracking.END_REASON]
    tracking.claim_run(uri, ids[0], end_on_exit=False)                    # the resume reopens the parent ...
    tracking._CHILDREN.clear()
    assert tracking.iteration_run(uri, ids[0], 1) == ids[1]               # ... and the iteration's child
    assert _statuses(uri, ids) == ["RUNNING", "RUNNING"]
    assert tracking.client(uri).get_run(ids[1]).data.tags["flyroll.reopened_from"] == "KILLED"


@pytest.mark.slow
def test_sigkill_during_weight_sync_then_resume_leaves_nothing_running_and_no_metric_gap(tmp_path):
    from mlflow.tracking import MlflowClient

    from infra import tracking
    from tests.support.processes import run_until_marker_then_kill

    hook = store_pause_hook(tmp_path / "hook")    # pauses right after the store publishes .../policy/v0002
    config = _config(tmp_path, loop={"iterations": 3, "eval_every": 2})
    cmd = [PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(config)]
    paused = tmp_path / "paused"
    env = {**_env(tmp_path), "PYTHONPATH": f"{hook}:{REPO}", "FLYROLL_TEST_PAUSE_PUBLISH": "/policy/v0002",
           "FLYROLL_TEST_PAUSED": str(paused)}
    run_until_marker_then_kill(cmd, tmp_path, env, paused, tmp_path / "first.log")  # paused in iteration 2's publish
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("flyroll")
    (parent,) = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    parent = parent.info.run_id
    assert c.get_run(parent).info.status == "RUNNING"                                   # what the kill leaves
    assert [m.step for m in c.get_metric_history(parent, "weight_sync/bytes")] == [1]    # iteration 2's never logged

    rerun = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-6000:]
    assert "resume from" in out and "/policy/v0002" in out

    running = c.search_runs([exp.experiment_id], filter_string="attributes.status = 'RUNNING'")
    assert not running, [(r.info.run_name, r.data.tags.get("flyroll.iteration")) for r in running]
    assert c.get_run(parent).info.status == "FINISHED"
    children = tracking.child_runs(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}", parent)
    assert sorted(children) == [1, 2, 3] and all(len(v) == 1 for v in children.values())
    for key in ("weight_sync/bytes", "timing/weight_sync_s"):
        assert sorted(m.step for m in c.get_metric_history(parent, key)) == [1, 2, 3], key
        for it, (child,) in children.items():
            assert [m.step for m in c.get_metric_history(child.info.run_id, key)] == [it], (key, it)
    for it, (child,) in children.items():
        assert child.info.status == "FINISHED", (it, child.info.status, child.data.tags.get(tracking.END_REASON))
    assert sorted(m.step for m in c.get_metric_history(parent, "eval/accuracy")) == [0, 2, 3]   # iteration 2's was owed
