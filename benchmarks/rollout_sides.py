"""The set-up shared by the rollout benchmarks (dynamic_sampling.py, partial_rollout.py): several
"sides", each the same config with a few fields changed, run through the real rollout task
(tasks/stages/rollout.py `rollout`) for the same iterations in one process on one local Ray instance, the
sides alternating within each iteration, each iteration's metrics read back from the side's MLflow run.

    work = isolated_workdir("flyroll-partial-bench-")          # HOME, caches, store and MLflow in a temp folder
    rows = run_sides(raw, {"whole": {"rollout": {...}}, ...}, work=work, prefix="partial-bench",
                     iterations=4, threads=0, metrics=lambda side: KEYS, report=print_row)
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def isolated_workdir(prefix: str) -> str:
    """A temporary folder that becomes HOME and the fetch cache of this process (so nothing lands in
    the user's), with Ray's usage stats off and any MLFLOW_TRACKING_URI dropped (each side's run
    folder holds its own MLflow store). Returns the folder; the caller prints it for deletion."""
    work = tempfile.mkdtemp(prefix=prefix)
    os.environ.update(HOME=os.path.join(work, "home"), FLYROLL_CACHE_DIR=os.path.join(work, "cache"),
                      RAY_USAGE_STATS_ENABLED="0")
    os.makedirs(os.environ["HOME"], exist_ok=True)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    return work


def side_config(raw: dict, name: str, changes: dict[str, dict], *, prefix: str, out: str, iterations: int,
                threads: int) -> dict:
    """`raw` (a parsed YAML preset) as side `name`: run name `<prefix>-<name>` under `out`,
    `loop.iterations`, `run.torch_threads` when `threads` > 0, and each section of `changes`
    merged into the config's section of that name."""
    cfg = copy.deepcopy(raw)
    cfg.setdefault("run", {}).update(name=f"{prefix}-{name}", output_dir=out)
    cfg.setdefault("loop", {})["iterations"] = max(iterations, 1)
    if threads:
        cfg["run"]["torch_threads"] = threads
    for section, fields in changes.items():
        cfg.setdefault(section, {}).update(fields)
    return cfg


def run_sides(raw: dict, sides: dict[str, dict[str, dict]], *, work: str, prefix: str, iterations: int, threads: int,
              metrics: Callable[[str], dict[str, str]], report: Callable[[int, str, dict], None]) -> dict[str, list[dict]]:
    """Prepare every side (config written to `work`, run, starting policy, dataset), then for
    iterations 1..`iterations` run each side's rollout in turn and read the last value of each
    MLflow metric `metrics(side)` maps a row field to; `report(iteration, side, row)` is called
    after each. Returns side -> its rows in iteration order. Ray is shut down at the end."""
    import yaml

    import tasks.stages.rollout
    from infra import tracking
    from infra.ray_session import shutdown
    from tasks.stages.prepare import build_base_policy, make_dataset, prepare_run

    runs = {}
    for name, changes in sides.items():
        path = os.path.join(work, f"{name}.yaml")
        cfg = side_config(raw, name, changes, prefix=prefix, out=os.path.join(work, "runs"), iterations=iterations, threads=threads)
        Path(path).write_text(yaml.safe_dump(cfg))
        spec, model_spec = prepare_run(config=path, restart=False)
        base = build_base_policy(model_spec)
        runs[name] = (spec, base, make_dataset(spec=spec, base=base))
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for it in range(1, iterations + 1):
            for name, (spec, policy, dataset) in runs.items():
                tasks.stages.rollout.rollout(spec=spec, policy=policy, dataset=dataset, iteration=it)
                client = tracking.client(spec.tracking_uri)
                row = {field: client.get_metric_history(spec.mlflow_run_id, key)[-1].value for field, key in metrics(name).items()}
                rows[name].append(row)
                report(it, name, row)
    finally:
        shutdown()
    return rows
