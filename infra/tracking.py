"""MLflow tracking: one parent run per workflow run, metrics per iteration, policy model versions.

Tracking URI: the config's `run.tracking_uri`, else `$MLFLOW_TRACKING_URI`, else a SQLite file in
the run folder. Every call goes through `MlflowClient` with an explicit run id, so tasks running
in different processes (or pods) log into the same run.
"""

from __future__ import annotations

import os
import time

REGISTERED_MODEL = "flyroll-policy"


def resolve_tracking_uri(configured: str | None, output_dir: str) -> str:
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    path = os.path.abspath(os.path.join(output_dir, "mlflow.db"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"sqlite:///{path}"


def client(tracking_uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def start_parent_run(tracking_uri: str, experiment: str, run_name: str, params: dict[str, str], tags: dict[str, str], artifact_location: str | None = None) -> str:
    """Create the experiment if needed and a parent run with the resolved config as params; returns its id."""
    from mlflow.entities import Param, RunTag

    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else c.create_experiment(experiment, artifact_location=artifact_location)
    run = c.create_run(exp_id, run_name=run_name, tags=tags)
    items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i : i + 100])
    c.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    return run.info.run_id


def find_run(tracking_uri: str, experiment: str, tag: str, value: str) -> str | None:
    """Id of the newest run of `experiment` tagged `tag=value`, or None."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`{tag}` = '{value}'", order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int) -> None:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v == v and abs(float(v)) != float("inf")]
    c = client(tracking_uri)
    for i in range(0, len(items), 500):
        c.log_batch(run_id, metrics=items[i : i + 500])


def set_tags(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client(tracking_uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_text(tracking_uri: str, run_id: str, text: str, artifact_file: str) -> None:
    client(tracking_uri).log_text(run_id, text, artifact_file)


def register_policy(tracking_uri: str, run_id: str, source_uri: str, tags: dict[str, str], aliases: tuple[str, ...] = ()) -> str:
    """Register a published checkpoint as a version of the `flyroll-policy` model; returns the version number.

    MLflow reserves the alias `latest` (`models:/flyroll-policy/latest` already resolves to the newest
    version), so callers pass other aliases (`champion`, ...)."""
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)
    try:
        c.create_registered_model(REGISTERED_MODEL, description="Policies published by flyroll runs (weight_sync stage).")
    except MlflowException:
        pass  # already exists
    mv = c.create_model_version(REGISTERED_MODEL, source=source_uri, run_id=run_id, tags=tags)
    for alias in aliases:
        c.set_registered_model_alias(REGISTERED_MODEL, alias, mv.version)
    return str(mv.version)


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status=status)
