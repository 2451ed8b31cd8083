"""MLflow tracking: one parent run per workflow run, a child run per iteration, policy model versions.

Tracking URI: the config's `run.tracking_uri`, else `$MLFLOW_TRACKING_URI`, else a SQLite file in
the run folder. Every call goes through `MlflowClient` with an explicit run id, so tasks running
in different processes (or pods) log into the same run.

Everything here is idempotent, because Flyte retries tasks and a killed run is resumed by rerunning
it: a metric is logged at most once per (run, key, step) -- the first write wins, as MLflow has no
way to delete or overwrite one point of a metric's history; the child run of an iteration and the
model version of a checkpoint are looked up by tag before they are created. See docs/lineage.md.

Nothing is left RUNNING: the process that opens or reopens a run (`claim_run`, `iteration_run`)
tags it with its owner (host, pid, process start time); a local run's process marks the runs it
owns FAILED when it exits before they end (an exception) and KILLED on SIGTERM; and a run whose
owner was SIGKILLed -- still RUNNING, its owner's pid gone from this host -- is marked KILLED, with
a tag saying why, by the next run that starts in its experiment (`end_orphaned_runs`). A resumed
run or iteration sets its run back to RUNNING.

A SQLite store that is read-only, corrupt, locked or full fails every call with `TrackingStoreError`
naming the file and what to do (infra/tracking_store.py; `prepare_run` checks it before the run starts).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import threading
import time

from infra.tracking_store import CheckedClient, checked_call


def resolve_tracking_uri(configured: str | None, output_dir: str) -> str:
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    path = os.path.abspath(os.path.join(output_dir, "mlflow.db"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"sqlite:///{path}"


OWNER_HOST, OWNER_PID, OWNER_START = "flyroll.owner_host", "flyroll.owner_pid", "flyroll.owner_start"
END_REASON = "flyroll.end_reason"


def _start_ticks(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat), to tell a recycled pid; None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_tags() -> dict[str, str]:
    """This process as a run's owner: host, pid and its start time."""
    return {OWNER_HOST: socket.gethostname(), OWNER_PID: str(os.getpid()), OWNER_START: _start_ticks(os.getpid()) or ""}


def owner_gone(tags: dict[str, str]) -> bool:
    """Whether the process named by a run's owner tags is known to be gone: it ran on this host and
    its pid no longer exists, or now belongs to a process started at another time. An owner on
    another host (a pod of a Flyte cluster) or a run without owner tags is never judged gone."""
    if tags.get(OWNER_HOST) != socket.gethostname() or not tags.get(OWNER_PID, "").isdigit():
        return False
    pid = int(tags[OWNER_PID])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, another user's
    started = _start_ticks(pid)
    return bool(tags.get(OWNER_START)) and started is not None and started != tags[OWNER_START]


def end_orphaned_runs(tracking_uri: str, experiment: str) -> list[str]:
    """Mark KILLED every RUNNING run (parent or child) of `experiment` whose owner is gone
    (`owner_gone`: killed, e.g. SIGKILL or OOM, without ending it), with a tag `flyroll.end_reason`
    naming the owner and who found it. Returns their ids."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    ended = []
    for r in c.search_runs([exp.experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=10_000):
        if owner_gone(r.data.tags):
            me = owner_tags()
            set_tags(tracking_uri, r.info.run_id, {
                END_REASON: f"KILLED: its owner, process {r.data.tags[OWNER_PID]} on {r.data.tags[OWNER_HOST]}, is gone without "
                            f"ending it (killed or crashed); found by process {me[OWNER_PID]} at {time.strftime('%Y-%m-%d %H:%M:%S')}"})
            c.set_terminated(r.info.run_id, status="KILLED")
            ended.append(r.info.run_id)
    return ended


_OWNED: dict[str, str] = {}   # run id -> tracking uri: runs this process ends (FAILED / KILLED) if it stops first
_EXIT_HOOKS = threading.Lock()
_HOOKED: list[bool] = []


def claim_run(tracking_uri: str, run_id: str, end_on_exit: bool, status: str | None = None) -> None:
    """Make this process the owner of run `run_id` (owner tags), set it RUNNING again when `status`
    (its status, when the caller has it; else it is read) says it was ended (a resumed run or a
    retried iteration), and with `end_on_exit` end it when this process exits before it is ended:
    FAILED on exit (an exception), KILLED on SIGTERM. Only a process that runs the whole run should
    pass `end_on_exit` (a local `pyflyte run`): a task pod on a Flyte cluster exits after its task
    with the run going on."""
    c = client(tracking_uri)
    status = status or c.get_run(run_id).info.status
    tags = owner_tags()
    if status != "RUNNING":
        c.update_run(run_id, status="RUNNING")
        tags["flyroll.reopened_from"] = status
    set_tags(tracking_uri, run_id, tags)
    if end_on_exit:
        _OWNED[run_id] = tracking_uri
        _hook_exit()


def _end_owned(status: str, reason: str) -> None:
    """End the runs this process owns that are still RUNNING, as `status`, tagged with `reason`."""
    for run_id, uri in list(_OWNED.items()):
        if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
            continue  # its database was deleted (a test's temp folder): nothing to end, and SQLAlchemy would log a traceback
        try:
            c = client(uri)
            if c.get_run(run_id).info.status == "RUNNING":
                set_tags(uri, run_id, {END_REASON: f"{status}: {reason} (process {os.getpid()} on {socket.gethostname()})"})
                c.set_terminated(run_id, status=status)
        except Exception:  # noqa: BLE001 -- the tracking server may be gone too; the next run ends it (end_orphaned_runs)
            pass
    _OWNED.clear()


def _hook_exit() -> None:
    """Once per process: end owned runs FAILED at exit, KILLED on SIGTERM (then the previous handler, or death)."""
    with _EXIT_HOOKS:
        if _HOOKED:
            return
        _HOOKED.append(True)
    atexit.register(_end_owned, "FAILED", "the process exited before the run ended")
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        _end_owned("KILLED", "the process got SIGTERM")
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def client(tracking_uri: str):
    """An `MlflowClient` of `tracking_uri` whose calls raise `TrackingStoreError` (naming the file, what
    is wrong and what to do) where a SQLite store fails as read-only, corrupt, locked or full."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow.tracking import MlflowClient

    return CheckedClient(checked_call(tracking_uri, "", MlflowClient, tracking_uri=tracking_uri), tracking_uri)


# MLflow 3's UI opens an experiment on its GenAI overview (traces, evaluations) unless told it is a
# model-training one. Two ways, for two generations of the UI: the experiment tag `mlflow.experimentKind`
# = "custom_model_development" (what the UI's experiment-kind selector writes; read by UIs that show that
# selector), and -- in MLflow 3.17, whose UI ignores the tag and follows its own GenAI / Model training
# switch, remembered per browser -- the URL parameter `workflowType=machine_learning` (`ui_links`).
EXPERIMENT_KIND, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
TRAINING_VIEW = "workflowType=machine_learning"
NOTE = "mlflow.note.content"   # a run's description: markdown shown at the top of its run page


def start_parent_run(tracking_uri: str, experiment: str, run_name: str, params: dict[str, str], tags: dict[str, str], artifact_location: str | None = None) -> str:
    """Create the experiment if needed (tagged as a training experiment, `EXPERIMENT_KIND`) and a parent
    run with the resolved config as params; returns its id."""
    from mlflow.entities import Param, RunTag

    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else c.create_experiment(experiment, artifact_location=artifact_location)
    if EXPERIMENT_KIND not in (exp.tags if exp else {}):  # a kind someone chose in the UI is kept
        c.set_experiment_tag(exp_id, EXPERIMENT_KIND, TRAINING_KIND)
    run = c.create_run(exp_id, run_name=run_name, tags=tags)
    items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i : i + 100])
    c.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    return run.info.run_id


def find_run(tracking_uri: str, experiment: str, tag: str, value: str) -> str | None:
    """Id of the newest top-level run of `experiment` tagged `tag=value` (child runs, which carry
    their parent's flyroll.run_id, are skipped), or None."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`{tag}` = '{value}'", order_by=["attributes.start_time DESC"], max_results=1000)
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return top[0].info.run_id if top else None


def logged_at_step(c, run_id: str, keys: list[str], step: int) -> set[str]:
    """Which of `keys` already have a point at `step` in run `run_id`.

    One `get_run` (its latest point per key carries the key's highest step); a key's full history is
    read only when its highest step is above `step` (an earlier step logged out of order)."""
    latest = {m.key: m.step for m in c.get_run(run_id).data.to_proto().metrics}
    done = set()
    for k in keys:
        if k not in latest or latest[k] < step:
            continue
        if latest[k] == step or any(m.step == step for m in c.get_metric_history(run_id, k)):
            done.add(k)
    return done


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int) -> dict[str, float]:
    """Log finite metrics at `step`, skipping any key already logged at that step (first write wins:
    a retried task or a resumed iteration never duplicates a point). Returns what was written."""
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    values = {k: float(v) for k, v in metrics.items() if v == v and abs(float(v)) != float("inf")}
    c = client(tracking_uri)
    for k in logged_at_step(c, run_id, list(values), step):
        del values[k]
    items = [Metric(k, v, ts, step) for k, v in values.items()]
    for i in range(0, len(items), 500):
        c.log_batch(run_id, metrics=items[i : i + 500])
    return values


_CHILDREN: dict[tuple[str, str, int], str] = {}  # (tracking uri, parent run, iteration) -> child run id


def iteration_run(tracking_uri: str, parent_run_id: str, iteration: int, tags: dict[str, str] | None = None,
                  end_on_exit: bool = False) -> str:
    """The child run `iteration-NNNN` of a parent run: found by its tags (mlflow.parentRunId +
    flyroll.iteration) or created, so a resumed run or a retried task reuses it. `tags` are set
    (overwritten) every call. The first call of a process claims it (`claim_run`: owner tags, RUNNING
    again if a killed or failed attempt ended it, `end_on_exit`). Stages of one iteration run one
    after another, so two creators never race; if they did, both children would be found and the
    oldest one used from then on."""
    c = client(tracking_uri)
    cache_key = (tracking_uri, parent_run_id, iteration)
    run_id = _CHILDREN.get(cache_key)
    if run_id is None:
        parent = c.get_run(parent_run_id)
        exp_id = parent.info.experiment_id
        found = c.search_runs([exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                                                      f"tags.`flyroll.iteration` = '{iteration}'",
                              order_by=["attributes.start_time ASC"], max_results=1)
        if found:
            run_id, status = found[0].info.run_id, found[0].info.status
        else:
            base = {"mlflow.parentRunId": parent_run_id, "flyroll.iteration": str(iteration)}
            if "flyroll.run_id" in parent.data.tags:
                base["flyroll.run_id"] = parent.data.tags["flyroll.run_id"]
            run_id, status = c.create_run(exp_id, run_name=f"iteration-{iteration:04d}", tags=base).info.run_id, "RUNNING"
        # a FINISHED child stays finished (its iteration is committed; its evaluation may still log into it)
        claim_run(tracking_uri, run_id, end_on_exit, status="RUNNING" if status == "FINISHED" else status)
        _CHILDREN[cache_key] = run_id
    if tags:
        set_tags(tracking_uri, run_id, tags)
    return run_id


def child_runs(tracking_uri: str, parent_run_id: str) -> dict[int, list]:
    """iteration -> the child runs of `parent_run_id` tagged with it (one each when all is well)."""
    c = client(tracking_uri)
    exp_id = c.get_run(parent_run_id).info.experiment_id
    out: dict[int, list] = {}
    for r in c.search_runs([exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=10_000):
        out.setdefault(int(r.data.tags.get("flyroll.iteration", -1)), []).append(r)
    return out


def set_tags(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client(tracking_uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_dataset(tracking_uri: str, run_id: str, name: str, digest: str, source: str, context: str,
                profile: dict | None = None) -> None:
    """Record a dataset as an input of run `run_id` (the run page's "Datasets" and the Runs table's
    dataset column): `name`, `digest` (its version; MLflow keeps at most 36 characters), `source`
    (its store URI) and `context` (train / eval). MLflow keeps one entry per (name, digest, context),
    so a retried task logs nothing twice."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    if len(digest) > 36:
        raise ValueError(f"dataset {name!r}: digest {digest!r} is {len(digest)} characters; MLflow keeps at most 36")
    scheme = source.split("://", 1)[0] if "://" in source else "local"
    ds = Dataset(name=name, digest=digest, source_type=scheme, source=json.dumps({"uri": source}),
                 profile=json.dumps(profile) if profile else None)
    client(tracking_uri).log_inputs(run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])])


def metric_page_link(experiment_id: str, run_id: str, keys: list[str]) -> str:
    """A link (relative to the MLflow UI's root, which routes on the URL fragment) to MLflow's metric
    page plotting `keys` of run `run_id` (the query MLflow's own `getMetricPageRoute` builds)."""
    from urllib.parse import quote

    query = {"runs": [run_id], "metric": keys[0], "experiments": [experiment_id], "plot_metric_keys": keys}
    return "#/metric/?" + "&".join(f"{k}={quote(json.dumps(v, separators=(',', ':')), safe='')}" for k, v in query.items())


def ui_links(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where to look at a run in the MLflow UI: the experiment's Runs table and the run page (opened
    in the Model training view), or, for a local SQLite store, the `mlflow ui` command to start first."""
    base = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else None
    prefix = base or "http://127.0.0.1:5000"
    links = (f"{prefix}/#/experiments/{experiment_id}?{TRAINING_VIEW}\n"
             f"  run: {prefix}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}")
    return links if base else f"mlflow ui --backend-store-uri {tracking_uri}, then {links}"


def log_text(tracking_uri: str, run_id: str, text: str, artifact_file: str) -> None:
    client(tracking_uri).log_text(run_id, text, artifact_file)


def find_model_version(tracking_uri: str, model: str, key: str):
    """The version of registered model `model` registered for artifact-store key `key` (tag flyroll.key), or None."""
    found = client(tracking_uri).search_model_versions(f"name='{model}' and tags.`flyroll.key` = '{key}'")
    return min(found, key=lambda mv: int(mv.version)) if found else None


def register_policy(tracking_uri: str, model: str, run_id: str, source_uri: str, key: str, tags: dict[str, str]) -> str:
    """Register checkpoint `key` (at `source_uri`) as a version of registered model `model` (the
    config's `run.registered_model`, default flyroll-policy), or find
    the version already registered for it (a retried or resumed weight sync); sets `tags` either way.
    Returns the version number.

    Aliases: MLflow reserves `latest` (`models:/<model>/latest` resolves to the newest version by
    itself and cannot be set); the champion alias (`run.champion_alias`) is set only by `set_alias`
    from the retraining workflow's promotion step. Aliases cannot hold '/', so the run a version belongs to is a tag (flyroll.run_id)."""
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)
    try:
        c.create_registered_model(model, description="Policies published by flyroll runs (weight_sync stage).")
    except MlflowException:
        pass  # already exists
    tags = {**tags, "flyroll.key": key}
    mv = find_model_version(tracking_uri, model, key)
    if mv is None:
        mv = c.create_model_version(model, source=source_uri, run_id=run_id, tags=tags)
    else:
        set_model_version_tags(tracking_uri, model, str(mv.version), tags)
    return str(mv.version)


def set_model_version_tags(tracking_uri: str, model: str, version: str, tags: dict[str, str]) -> None:
    c = client(tracking_uri)
    for k, v in tags.items():
        c.set_model_version_tag(model, version, k, str(v))


def model_version(tracking_uri: str, model: str, version: str):
    return client(tracking_uri).get_model_version(model, version)


def alias_version(tracking_uri: str, model: str, alias: str):
    """The version of registered model `model` behind `alias`, or None (no model, or no such alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return client(tracking_uri).get_model_version_by_alias(model, alias)
    except MlflowException:
        return None


def set_alias(tracking_uri: str, model: str, alias: str, version: str) -> None:
    if alias == "latest":
        raise ValueError(f"the alias 'latest' is reserved by MLflow: models:/{model}/latest already is the newest version")
    client(tracking_uri).set_registered_model_alias(model, alias, version)


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status=status)
    _OWNED.pop(run_id, None)
