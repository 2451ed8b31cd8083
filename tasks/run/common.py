"""Helpers every stage task shares: config and store from a RunSpec, stage timing and logging."""

from __future__ import annotations

import functools
import os
import shutil
import time
from contextlib import contextmanager, suppress

import flytekit
import numpy as np
import pandas as pd
from filelock import FileLock, Timeout
from rich.console import Console

from configs.schema import FlyrollConfig
from engines.data.rollout_table import COLUMNS, STAGES, Column
from infra import ray_cluster, tracking
from infra.ray_session import is_local_execution
from infra.store import ArtifactStore
from tasks.run.keys import parse_version_name, rollout_table_key, series_version
from tasks.run.types import RunSpec

console = Console(stderr=True, highlight=False, soft_wrap=True)

# what the terminal shows per stage (everything goes to MLflow)
_SHOWN = ("rollout/response_length", "rollout/truncated_frac", "reward/mean", "reward/errors", "reference/kl_k3",
          "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "training/tokens_per_s",
          "weight_sync/bytes", "eval/accuracy")


def config_of(spec: RunSpec) -> FlyrollConfig:
    """The run's config, parsed once per process (and config): every stage, actor and helper that
    asks gets the same object. It is frozen (pydantic `frozen=True`); its dict and list fields are
    copied by whoever needs their own (`dict(cfg.reward.functions)`), never changed in place."""
    return _parsed(spec.config_json)


@functools.lru_cache(maxsize=8)
def _parsed(config_json: str) -> FlyrollConfig:
    return FlyrollConfig.model_validate_json(config_json)


def store_of(spec: RunSpec) -> ArtifactStore:
    return ArtifactStore(spec.store_uri)


def cache_dir(spec: RunSpec) -> str:
    """Local folder where fetched artifacts are kept (per machine)."""
    root = os.environ.get("FLYROLL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flyroll")
    return os.path.join(root, spec.run_id.replace("/", "_"))


TRAINER_STATE = "trainer_state.pt"  # a checkpoint's optimizer, LR schedule and objective state, beside the weights
TRAINING_ONLY = (TRAINER_STATE, "critic/")  # what only a trainer or critic reads (critic/: engines/training/critic_model.py
                                            # CRITIC_SUBDIR, not imported here: that module pulls in transformers)
# What a cached copy may leave out, fullest first (each leaves out more than the one before), and its marker
_CACHED = {(): ".complete", (TRAINER_STATE,): ".complete-models", TRAINING_ONLY: ".complete-weights"}
_MARKERS = tuple(_CACHED.values())


def fetch_cached(spec: RunSpec, key: str, skip: tuple[str, ...] = ()) -> str:
    """Local directory holding artifact `key`, fetched (and hash-verified) once per machine, and
    checked again against the version's manifest on every later call (`ArtifactStore.check_fetched`:
    a file whose stat stamp changed since the verified fetch is re-hashed); a copy that no longer
    matches is deleted and fetched again, never served.
    `skip`: leave out files, one of `_CACHED`'s sets: `TRAINING_ONLY` for generation and log-prob
    actors (SmolLM2's optimizer state is 1.1 of its 1.6 GB), `(TRAINER_STATE,)` for the critic's
    values. A later fetch that needs more of a cached version fetches only what it lacks.
    Fetching version N of one of the run's own series (`runs/<run_id>/policy/v0007`) deletes that
    series' cached versions older than N-1 (`evict_older_versions`).
    Processes of one machine share the cache (DDP ranks, generation and training actors loading the
    same version at once): a file lock per version (`.locks/` in the cache folder; the empty lock
    files stay) makes one of them fetch while the others wait, so none reads a file another is
    still writing."""
    skip = tuple(skip)
    if skip not in _CACHED:
        raise ValueError(f"fetch_cached: skip must be one of {list(_CACHED)}, got {skip!r}")
    dest = os.path.join(cache_dir(spec), key)
    with FileLock(_lock_path(spec, key)):
        have = [s for s, marker in _CACHED.items() if os.path.exists(os.path.join(dest, marker))]
        if have and (bad := store_of(spec).check_fetched(key, dest, skip=min(have, key=len))):
            console.print(f"[yellow]cached copy of {key} does not match its manifest ({', '.join(bad)}): fetching it again[/]")
            _drop_cached(dest)  # never served: the store's copy is fetched (and verified) anew
            have = []
        if not any(set(s) <= set(skip) for s in have):
            # a verified copy with less is cached (the fullest one's marker): fetch only the files it left out
            include = min(have, key=len) if have else None
            store_of(spec).fetch(key, dest, verify=True, skip=skip, include=include, stamp=True)
            open(os.path.join(dest, _CACHED[skip]), "w").close()
    evict_older_versions(spec, key)
    return dest


def _drop_cached(path: str) -> None:
    """Delete a cached version: its markers first (not complete any more), then its files."""
    for marker in _MARKERS:
        with suppress(FileNotFoundError):
            os.remove(os.path.join(path, marker))
    shutil.rmtree(path, ignore_errors=True)


def _lock_path(spec: RunSpec, key: str) -> str:
    """The file lock of cached version `key` (one empty file per version, under `.locks/`)."""
    folder = os.path.join(cache_dir(spec), ".locks")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, key.replace("/", "__") + ".lock")


def evict_older_versions(spec: RunSpec, key: str) -> list[str]:
    """Delete the local copies of the versions of `key`'s series older than the one before `key`
    (the store keeps every version: a later fetch of one gets it again). A run's checkpoints are
    fetched in order, one per iteration, so without this the cache grew by a checkpoint per
    iteration (13 GB after 8 SmolLM2 iterations). Only the run's own series (`runs/...`); the base
    model (`models/...`, the reference) stays. A version whose lock another process holds (it is
    fetching that version right now, e.g. a generator lagging `pipeline.off_policy_steps` behind) is
    left alone; a later fetch evicts it. Returns the folders deleted."""
    parsed = series_version(key)
    if parsed is None:
        return []
    series, version = parsed
    folder = os.path.join(cache_dir(spec), series)
    deleted = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        old = parse_version_name(name)
        if not (old is not None and old < version - 1):
            continue
        lock = FileLock(_lock_path(spec, f"{series}/{name}"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            path = os.path.join(folder, name)
            for marker in _MARKERS:  # not complete any more before any file goes
                with suppress(FileNotFoundError):
                    os.remove(os.path.join(path, marker))
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
        finally:
            lock.release()
    return deleted


def execution_id() -> str:
    try:
        eid = flytekit.current_context().execution_id
        return f"{eid.project}:{eid.domain}:{eid.name}"
    except Exception:  # noqa: BLE001 -- outside a Flyte task
        return "none"


def iteration_run(spec: RunSpec, iteration: int, tags: dict[str, str] | None = None) -> str:
    """The MLflow child run `iteration-NNNN` of this run (found or created), tagged with the Flyte
    execution id and the rollout table's key and URI (plus `tags`)."""
    base = {"flyte.execution_id": execution_id(), "flyroll.rollout_table": rollout_table_key(spec, iteration),
            "flyroll.rollout_table_uri": f"{spec.store_uri.rstrip('/')}/{rollout_table_key(spec, iteration)}"}
    return tracking.iteration_run(spec.tracking_uri, spec.mlflow_run_id, iteration, {**base, **(tags or {})},
                                  end_on_exit=is_local_execution())


def log_iteration_metrics(spec: RunSpec, iteration: int, metrics: dict[str, float]) -> None:
    """Metrics of iteration `iteration` at step=iteration: into the parent run, and (iteration >= 1)
    into that iteration's child run. Idempotent per (run, key, step), so retries and resumes never
    duplicate a point (infra/tracking.py)."""
    tracking.log_metrics(spec.tracking_uri, spec.mlflow_run_id, metrics, step=iteration)
    if iteration >= 1:
        tracking.log_metrics(spec.tracking_uri, iteration_run(spec, iteration), metrics, step=iteration)


WEIGHT_SYNC_OWED = ("weight_sync/bytes", "timing/weight_sync_s")


def settle_published_iteration(spec: RunSpec, key: str) -> dict[str, float]:
    """What the weight sync of published policy version `key` owes MLflow when its process was killed
    after the publish but before the stage ended (the resume starts after it, so nothing else would
    log it): `weight_sync/bytes` (from the manifest) and `timing/weight_sync_s` (stage start to the
    manifest write), at step=iteration in the parent and the iteration's child run, which is then
    ended FINISHED (the iteration is committed). First write wins, so after a whole stage this logs
    nothing. Returns what was written to the parent run."""
    from datetime import datetime

    m = store_of(spec).manifest(key)
    iteration = int(m.metadata.get("iteration", 0))
    if iteration < 1:
        return {}
    owed = {"weight_sync/bytes": float(sum(f.size for f in m.files.values()))}
    if "weight_sync_started" in m.metadata and m.created_at:
        owed["timing/weight_sync_s"] = max(0.0, datetime.fromisoformat(m.created_at).timestamp() - float(m.metadata["weight_sync_started"]))
    written = tracking.log_metrics(spec.tracking_uri, spec.mlflow_run_id, owed, step=iteration)
    child = tracking.iteration_run(spec.tracking_uri, spec.mlflow_run_id, iteration)
    tracking.log_metrics(spec.tracking_uri, child, owed, step=iteration)
    if tracking.client(spec.tracking_uri).get_run(child).info.status != "FINISHED":
        tracking.set_tags(spec.tracking_uri, child, {"flyroll.model_version": str(m.metadata.get("model_version", "")),
                                                     "flyroll.settled": f"weight sync completed by a resume ({execution_id()})"})
        tracking.end_run(spec.tracking_uri, child)
    return written


def logged(spec: RunSpec, key: str, step: int) -> bool:
    """Whether the parent run has metric `key` at `step`."""
    return bool(tracking.logged_at_step(tracking.client(spec.tracking_uri), spec.mlflow_run_id, [key], step))


@contextmanager
def stage(spec: RunSpec, name: str, iteration: int, metrics: dict):
    """Times a stage, logs `timing/<name>_s` + the stage's metrics at step=iteration to the MLflow
    parent run and the iteration's child run; `<name>/tokens` also gives `<name>/tokens_per_s`; in
    the per-task Ray mode also its cluster's start seconds and node count."""
    t0 = time.perf_counter()
    yield
    dt = time.perf_counter() - t0
    metrics[f"timing/{name}_s"] = dt
    if ray_cluster.CURRENT:  # FLYROLL_RAY=per-task: this task's own Ray cluster (started before the stage)
        metrics[f"timing/{name}_ray_start_s"] = ray_cluster.CURRENT["start_s"]
        metrics[f"ray/{name}_nodes"] = ray_cluster.CURRENT["nodes"]
    if f"{name}/tokens" in metrics and f"{name}/tokens_per_s" not in metrics:
        metrics[f"{name}/tokens_per_s"] = metrics[f"{name}/tokens"] / max(dt, 1e-9)
    log_iteration_metrics(spec, iteration, metrics)
    keys = [k for k in _SHOWN if k in metrics] + sorted(k for k in metrics if k.startswith("eval/accuracy/"))
    shown = "  ".join(f"{k}={metrics[k]:.3g}" for k in keys)
    console.print(f"[bold cyan]iter {iteration:>3}[/] ▸ {name:<11} [green]{dt:6.2f}s[/]  {shown}")


def check_columns(df: pd.DataFrame, *stages: str, at: str = "at a stage boundary") -> None:
    """Schema check of the rollout table at a task boundary, against engines/data/rollout_table.py `COLUMNS`: every
    column the given `stages` write is there (optional ones: checked when present) and of its declared
    dtype, and every token-level (`aligned`) column has one entry per `response_token_ids` token in
    every row. Raises ValueError naming the boundary `at` ("entering training"), the column, the
    dtype expected and what was found. Cost: one pass over the cells of each object column."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"check_columns: unknown stage(s) {unknown}, expected some of {list(STAGES)}")
    where = f"rollout table {at}"
    declared = [c for c in COLUMNS if c.writer in stages]
    missing = [c.name for c in declared if not c.optional and c.name not in df.columns]
    if missing:
        raise ValueError(f"{where}: missing columns {missing} (has {list(df.columns)})")
    present = [c for c in declared if c.name in df.columns]
    for c in present:
        found = _dtype_mismatch(df[c.name], c)
        if found:
            raise ValueError(f"{where}: column {c.name!r} expected {c.dtype}{' or None' if c.nullable else ''}, got {found}")
    if "response_token_ids" in df.columns:
        tokens = df["response_token_ids"].map(len).to_numpy()
        for c in present:
            if c.aligned:
                lengths = df[c.name].map(len).to_numpy()
                bad = (lengths != tokens).nonzero()[0]
                if len(bad):
                    i = int(bad[0])
                    raise ValueError(f"{where}: column {c.name!r} must hold one entry per response token, but row {i} "
                                     f"has {lengths[i]} for {tokens[i]} tokens of 'response_token_ids' ({len(bad)} such rows)")


def _short(v) -> str:
    r = repr(v.item() if hasattr(v, "item") and getattr(v, "ndim", 1) == 0 else v)
    return r if len(r) <= 40 else r[:37] + "..."


def _element_ok(x, kind: str) -> bool:
    """Is scalar `x` of `kind` ("int", "float", "bool", "str")? Bools are not numbers here."""
    if kind == "str":
        return isinstance(x, str)
    if kind == "bool":
        return isinstance(x, (bool, np.bool_))
    if isinstance(x, (bool, np.bool_)):
        return False
    return isinstance(x, (int, np.integer)) or (kind == "float" and isinstance(x, (float, np.floating)))


def _dtype_mismatch(s: pd.Series, col: Column) -> str | None:
    """What is wrong with column `s` for its declaration `col`, as "<found> (<where>)"; None when it fits."""
    nulls = s.isna() if not col.dtype.startswith("list") else s.map(lambda v: v is None or (isinstance(v, float) and v != v))
    if col.nullable and bool(nulls.all()):
        return None
    if col.dtype in ("int", "float", "bool"):
        kinds = {"int": "iu", "float": "fiu", "bool": "b"}[col.dtype]
        if s.dtype.kind in kinds:
            return None
        i, v = next(((i, v) for i, (v, null) in enumerate(zip(s, nulls)) if null or not _element_ok(v, col.dtype)),
                    (0, s.iloc[0] if len(s) else None))
        return f"{s.dtype} (first value {_short(v)}, row {i})"
    if col.dtype == "str" and s.dtype.kind not in "OSU" and not isinstance(s.dtype, pd.StringDtype):
        return f"{s.dtype} (first value {_short(s.iloc[0]) if len(s) else None}, row 0)"
    element = col.dtype[5:-1] if col.dtype.startswith("list") else None
    for i, (v, null) in enumerate(zip(s, nulls)):
        if null:
            if col.nullable:
                continue
            return f"null in row {i}"
        if element is None:
            if not _element_ok(v, col.dtype):
                return f"{type(v).__name__} in row {i} ({_short(v)})"
        elif isinstance(v, np.ndarray):
            if v.ndim != 1 or (v.size and v.dtype.kind not in {"int": "iu", "float": "fiu"}[element]):
                return f"array of {v.dtype} (shape {v.shape}) in row {i}"
        elif not isinstance(v, (list, tuple)):
            return f"{type(v).__name__} in row {i} ({_short(v)})"
        elif v and not _element_ok(v[0], element):
            return f"list of {type(v[0]).__name__} in row {i} ({_short(v)})"
    return None
