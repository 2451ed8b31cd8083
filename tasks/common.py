"""Helpers every stage task shares: config and store from a RunSpec, stage timing and logging."""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import contextmanager, suppress

import pandas as pd
from rich.console import Console

from configs.schema import FlyrollConfig
from infra import tracking
from infra.store import ArtifactStore
from tasks.types import ROLLOUT_COLUMNS, RunSpec

console = Console(stderr=True, highlight=False, soft_wrap=True)

# what the terminal shows per stage (everything goes to MLflow)
_SHOWN = ("rollout/response_length", "rollout/truncated_frac", "reward/mean", "reward/errors", "reference/kl_k3",
          "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "training/tokens_per_s",
          "weight_sync/bytes", "eval/accuracy")


def config_of(spec: RunSpec) -> FlyrollConfig:
    return FlyrollConfig.model_validate_json(spec.config_json)


def store_of(spec: RunSpec) -> ArtifactStore:
    return ArtifactStore(spec.store_uri)


def cache_dir(spec: RunSpec) -> str:
    """Local folder where fetched artifacts are kept (per machine)."""
    root = os.environ.get("FLYROLL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flyroll")
    return os.path.join(root, spec.run_id.replace("/", "_"))


TRAINER_STATE = "trainer_state.pt"  # a checkpoint's optimizer, LR schedule and objective state, beside the weights
TRAINING_ONLY = (TRAINER_STATE, "critic/")  # what only a trainer or critic reads (critic/: engines/critic_model.py
                                            # CRITIC_SUBDIR, not imported here: that module pulls in transformers)
# What a cached copy may leave out, fullest first (each leaves out more than the one before), and its marker
_CACHED = {(): ".complete", (TRAINER_STATE,): ".complete-models", TRAINING_ONLY: ".complete-weights"}
_MARKERS = tuple(_CACHED.values())


def fetch_cached(spec: RunSpec, key: str, skip: tuple[str, ...] = ()) -> str:
    """Local directory holding artifact `key`, fetched (and hash-verified) once per machine.
    `skip`: leave out files, one of `_CACHED`'s sets: `TRAINING_ONLY` for generation and log-prob
    actors (SmolLM2's optimizer state is 1.1 of its 1.6 GB), `(TRAINER_STATE,)` for the critic's
    values. A later fetch that needs more of a cached version fetches only what it lacks.
    Fetching version N of one of the run's own series (`runs/<run_id>/policy/v0007`) deletes that
    series' cached versions older than N-1 (`evict_older_versions`)."""
    skip = tuple(skip)
    if skip not in _CACHED:
        raise ValueError(f"fetch_cached: skip must be one of {list(_CACHED)}, got {skip!r}")
    dest = os.path.join(cache_dir(spec), key)
    have = [s for s, marker in _CACHED.items() if os.path.exists(os.path.join(dest, marker))]
    if not any(set(s) <= set(skip) for s in have):
        # a verified copy with less is cached (the fullest one's marker): fetch only the files it left out
        include = min(have, key=len) if have else None
        store_of(spec).fetch(key, dest, verify=True, skip=skip, include=include)
        open(os.path.join(dest, _CACHED[skip]), "w").close()
    evict_older_versions(spec, key)
    return dest


_RUN_VERSION = re.compile(r"(runs/.+)/v(\d+)")


def evict_older_versions(spec: RunSpec, key: str) -> list[str]:
    """Delete the local copies of the versions of `key`'s series older than the one before `key`
    (the store keeps every version: a later fetch of one gets it again). A run's checkpoints are
    fetched in order, one per iteration, so without this the cache grew by a checkpoint per
    iteration (13 GB after 8 SmolLM2 iterations). Only the run's own series (`runs/...`); the base
    model (`models/...`, the reference) stays. Returns the folders deleted."""
    m = _RUN_VERSION.fullmatch(key)
    if not m:
        return []
    folder, version = os.path.join(cache_dir(spec), m.group(1)), int(m.group(2))
    deleted = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        old = re.fullmatch(r"v(\d+)", name)
        if old and int(old.group(1)) < version - 1:
            path = os.path.join(folder, name)
            for marker in _MARKERS:  # not complete any more before any file goes
                with suppress(FileNotFoundError):
                    os.remove(os.path.join(path, marker))
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


def execution_id() -> str:
    try:
        import flytekit

        eid = flytekit.current_context().execution_id
        return f"{eid.project}:{eid.domain}:{eid.name}"
    except Exception:  # noqa: BLE001 -- outside a Flyte task
        return "none"


def rollout_table_key(spec: RunSpec, iteration: int) -> str:
    """Where the reference stage publishes iteration `iteration`'s complete rollout table."""
    return f"runs/{spec.run_id}/rollouts/i{iteration:04d}"


def iteration_run(spec: RunSpec, iteration: int, tags: dict[str, str] | None = None) -> str:
    """The MLflow child run `iteration-NNNN` of this run (found or created), tagged with the Flyte
    execution id and the rollout table's key and URI (plus `tags`)."""
    base = {"flyte.execution_id": execution_id(), "flyroll.rollout_table": rollout_table_key(spec, iteration),
            "flyroll.rollout_table_uri": f"{spec.store_uri.rstrip('/')}/{rollout_table_key(spec, iteration)}"}
    return tracking.iteration_run(spec.tracking_uri, spec.mlflow_run_id, iteration, {**base, **(tags or {})})


def log_iteration_metrics(spec: RunSpec, iteration: int, metrics: dict[str, float]) -> None:
    """Metrics of iteration `iteration` at step=iteration: into the parent run, and (iteration >= 1)
    into that iteration's child run. Idempotent per (run, key, step), so retries and resumes never
    duplicate a point (infra/tracking.py)."""
    tracking.log_metrics(spec.tracking_uri, spec.mlflow_run_id, metrics, step=iteration)
    if iteration >= 1:
        tracking.log_metrics(spec.tracking_uri, iteration_run(spec, iteration), metrics, step=iteration)


@contextmanager
def stage(spec: RunSpec, name: str, iteration: int, metrics: dict):
    """Times a stage, logs `timing/<name>_s` + the stage's metrics at step=iteration to the MLflow
    parent run and the iteration's child run; `<name>/tokens` also gives `<name>/tokens_per_s`."""
    t0 = time.perf_counter()
    yield
    dt = time.perf_counter() - t0
    metrics[f"timing/{name}_s"] = dt
    if f"{name}/tokens" in metrics and f"{name}/tokens_per_s" not in metrics:
        metrics[f"{name}/tokens_per_s"] = metrics[f"{name}/tokens"] / max(dt, 1e-9)
    log_iteration_metrics(spec, iteration, metrics)
    keys = [k for k in _SHOWN if k in metrics] + sorted(k for k in metrics if k.startswith("eval/accuracy/"))
    shown = "  ".join(f"{k}={metrics[k]:.3g}" for k in keys)
    console.print(f"[bold cyan]iter {iteration:>3}[/] ▸ {name:<11} [green]{dt:6.2f}s[/]  {shown}")


def check_columns(df: pd.DataFrame, *stages: str) -> None:
    """The rollout table must carry every column the given stages add (schema check at a task boundary)."""
    missing = [c for s in stages for c in ROLLOUT_COLUMNS[s] if c not in df.columns]
    if missing:
        raise ValueError(f"rollout table is missing columns {missing} (has {list(df.columns)})")
