"""`flyroll lineage` on a real e2e run (local store, SQLite MLflow): the same chain from a model version
number, an MLflow run id and a store key, as text and as `--json`; unknown targets fail clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.workflow import _env

pytestmark = pytest.mark.slow

FLYROLL = str(Path(sys.executable).with_name("flyroll"))


@pytest.fixture(scope="module")
def run(e2e_run):
    """The session's e2e run (tests/conftest.py; tests/e2e/test_workflow.py reads it too), read only."""
    from mlflow.tracking import MlflowClient

    tmp = e2e_run[0]
    tracking_uri = f"sqlite:///{tmp / 'runs' / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=tracking_uri)
    exp = c.get_experiment_by_name("flyroll")
    (parent,) = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    versions = sorted(c.search_model_versions("name='flyroll-policy'"), key=lambda v: int(v.version))
    return {"tmp": tmp, "store": str(tmp / "runs" / "store"), "tracking": tracking_uri, "parent": parent, "versions": versions}


def _lineage(run, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([FLYROLL, "lineage", *args, "--store", run["store"], "--tracking-uri", run["tracking"]],
                          cwd=run["tmp"], env=_env(run["tmp"]), capture_output=True, text=True, timeout=120)


def test_model_version_run_id_and_key_give_the_same_chain(run):
    final = run["versions"][-1]
    key = final.tags["flyroll.key"]
    records = {}
    for target in (str(final.version), run["parent"].info.run_id, key, f"{run['store']}/{key}"):
        proc = _lineage(run, target, "--json")
        assert proc.returncode == 0, proc.stderr
        records[target] = json.loads(proc.stdout)
    chains = {t: [v["key"] for v in r["chain"]] for t, r in records.items()}
    assert len({tuple(c) for c in chains.values()}) == 1, chains
    rec = records[str(final.version)]
    run_id = run["parent"].data.tags["flyroll.run_id"]
    assert [v["key"] for v in rec["chain"]][:2] == [f"runs/{run_id}/policy/v0002", f"runs/{run_id}/policy/v0001"]
    assert rec["policy"] == key and rec["base_model"] == rec["chain"][-1]["key"] and rec["base_model"].startswith("models/tiny-")
    assert [v["metadata"].get("iteration") for v in rec["chain"][:2]] == [2, 1]
    mlflow_view = [v.get("mlflow", {}) for v in rec["chain"]]
    assert [str(m.get("model_version")) for m in mlflow_view[:2]] == [str(v.version) for v in reversed(run["versions"])]
    assert all(m["run_id"] == run["parent"].info.run_id for m in mlflow_view[:2]) and "mlflow" not in rec["chain"][-1]
    (data,) = rec["datasets"]
    assert data["key"] == final.tags["flyroll.dataset"] and data["rows"] == 64 and set(data["domains"]) == {"arithmetic", "reverse"}


def test_text_output_reads_as_a_chain_back_to_the_base(run):
    proc = _lineage(run, str(run["versions"][-1].version))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "/policy/v0002" in lines[0] and "iteration 2" in lines[0] and "MLflow model version" in lines[0]
    assert lines[1].startswith("  ← ") and "/policy/v0001" in lines[1]
    assert lines[2].startswith("  ← models/tiny-") and "bootstrap_policy" in lines[2]
    assert lines[3].startswith("dataset datasets/") and "64 rows" in lines[3]


def test_unknown_targets_fail_with_a_clear_message(run):
    proc = _lineage(run, "runs/nope/policy/v0001")
    assert proc.returncode == 2 and "no artifact version 'runs/nope/policy/v0001'" in proc.stderr


def test_run_page_and_report_carry_the_lineage(run):
    """finalize writes the lineage and the key charts into the run description and report.html;
    make_dataset logs both splits as MLflow dataset inputs; the experiment is a training one."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=run["tracking"])
    parent = c.get_run(run["parent"].info.run_id)
    final = run["versions"][-1]
    key, run_id = final.tags["flyroll.key"], parent.data.tags["flyroll.run_id"]
    assert c.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("**Key charts:** [eval/accuracy](#/metric/?") and " → " in note and "(×" in note
    assert f"final policy: {key}".replace("_", "\\_") in note
    assert f"config hash: {parent.data.tags['flyroll.config_hash']}" in note and "base model: models/tiny-" in note
    inputs = {i.dataset.name: i for i in parent.inputs.dataset_inputs}
    assert sorted(inputs) == ["synthetic/eval", "synthetic/train"]
    train = inputs["synthetic/train"]
    assert train.dataset.digest in final.tags["flyroll.dataset"] and final.tags["flyroll.dataset"] in train.dataset.source
    report = (run["tmp"] / "runs" / run_id / "report.html").read_text()
    assert "<h2>Lineage</h2>" in report and key in report and "reference answer" in report and "improvement" not in report
