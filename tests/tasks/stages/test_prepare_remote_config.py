"""A run on a Flyte cluster must name its artifact store and MLflow server: the local defaults
(`<output_dir>/store`, a SQLite file) would live in one pod and vanish with it."""

from __future__ import annotations

import pytest
import yaml

from tests.support.workflow import REPO

REMOTE = {"FLYTE_INTERNAL_EXECUTION_ID": "f3a9c1d2", "FLYTE_INTERNAL_EXECUTION_PROJECT": "flyroll"}


def _config(tmp_path, **run):
    cfg = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    cfg["run"].update(output_dir=str(tmp_path / "runs"), **run)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("run, env, named", [
    ({}, {}, ["FLYROLL_STORE_URI", "MLFLOW_TRACKING_URI"]),
    ({"store_uri": "s3://flyroll/runs"}, {}, ["MLFLOW_TRACKING_URI"]),
    ({}, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}, ["FLYROLL_STORE_URI"]),
])
def test_remote_run_without_store_or_tracking_is_refused_before_writing(tmp_path, monkeypatch, run, env, named):
    from tasks.stages.prepare import prepare_run

    for k in ("FLYROLL_STORE_URI", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**REMOTE, **env}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="Flyte cluster") as e:
        prepare_run(config=_config(tmp_path, **run), restart=False)
    for name in named:
        assert name in str(e.value)
    assert not (tmp_path / "runs").exists()  # refused before any store, SQLite file or MLflow run was made


def test_remote_run_naming_both_passes_the_check_and_a_local_run_needs_neither(tmp_path):
    from configs.schema import load_config
    from tasks.stages.prepare import check_remote_uris

    named = load_config(_config(tmp_path, store_uri="s3://flyroll/runs", tracking_uri="http://mlflow:5000"))
    check_remote_uris(named, REMOTE)
    check_remote_uris(load_config(_config(tmp_path)), {})  # local pyflyte run: the embedded defaults
    check_remote_uris(load_config(_config(tmp_path)), {**REMOTE, "FLYROLL_STORE_URI": "s3://b/p",
                                                       "MLFLOW_TRACKING_URI": "http://mlflow:5000"})
