"""Scheduled retraining: continue RL from the current champion, and promote the result only if it is better.

    pyflyte run workflows/schedules.py retrain --config configs/tiny.yaml --iterations 4     # locally, once
    pyflyte run workflows/schedules.py retrain --set '["training.lr=1e-5"]'                  # with overrides
    pyflyte --pkgs workflows package      # includes the nightly launch plan and its cron schedule (docs/cluster.md)

`retrain` starts from the champion alias (`run.champion_alias`, default `champion`) of the config's
registered model (`run.model_name`, default `<run.experiment>-policy` = flyroll-policy) (or, when no
version holds it yet, from the config's model, bootstrapped if need be), takes the dataset snapshot
of the config's data section and the content of its files (rows appended since the last run make a
new snapshot: docs/data.md "Dataset identity"), runs N RL iterations with the same building blocks as
`workflows/rlvr.py` (KL reference = the champion), evaluates greedily on the fixed eval split, and
moves `champion` to the new policy only if its eval accuracy beats the champion's score. The
champion's score is the one recorded on its model version when it was promoted (tag
`flyroll.eval_accuracy`, on the same eval split); when there is none -- a champion set by hand, the
base model, a different eval split -- it is the champion's accuracy measured by this run at
iteration 0. Both scores and the decision are tags on the new model version and on the run.

Every retrain is a new run (`<run.name>-<config hash>-<timestamp>`): its policy versions live under
`runs/<that id>/policy/`, and their manifests' parents lead back through the champion's own run to
the base model (`flyroll lineage`). A killed retrain is not resumed; the next one starts over from
the champion, which a failed retrain never moves.

`retrain_plan(name, config, cron)` makes a scheduled launch plan of `retrain` for any preset; the
nightly one below is made with it, and a project's own module in the registered packages can add
more (docs/cluster.md).
"""

from __future__ import annotations

import typing
import warnings
from pathlib import Path

from flytekit import CronSchedule, LaunchPlan, task, workflow

from configs.schema import load_config

from infra import tracking
from infra.resources import task_resources
from tasks.run.common import config_of, console, store_of
from tasks.stages.evaluation import finalize
from tasks.stages.prepare import build_base_policy, loop_bounds, make_dataset, prepare_run
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from workflows.rlvr import rl_loop

ROOT = Path(__file__).resolve().parents[1]   # the code's root: relative presets are read from here, as in the task image

warnings.filterwarnings("ignore", message="The parameter --restart is used more than once")

Decision = typing.NamedTuple("Decision", [("trained", PolicyRef), ("champion", PolicyRef), ("promoted", bool)])
RetrainOut = typing.NamedTuple("RetrainOut", [("policy", PolicyRef), ("champion", PolicyRef), ("promoted", bool)])


@task(**task_resources("promotion"))
def current_champion(spec: RunSpec, model_spec: str) -> PolicyRef:
    """The policy the champion alias points at (as version 0 of this run), or the config's base model
    when no version holds the alias. The champion must live in this run's artifact store."""
    store = store_of(spec)
    model, alias = config_of(spec).run.registered_model, config_of(spec).run.champion_alias
    mv = tracking.alias_version(spec.tracking_uri, model, alias)
    if mv is None:
        start = build_base_policy(model_spec)
        console.print(f"[bold]retrain[/] no {alias} of {model} yet: starting from the config's model {start.key}")
    else:
        key = mv.tags.get("flyroll.key") or ""
        if not key or mv.source != store.uri(key):
            raise ValueError(f"{alias} = {model} version {mv.version} at {mv.source} is not in this "
                             f"run's artifact store {store.root}; set run.store_uri to the store it was published to")
        store.manifest(key)  # ArtifactNotFound names the URI when the checkpoint is gone
        start = PolicyRef(key=key, version=0, model_version=str(mv.version))
        console.print(f"[bold]retrain[/] from {alias}: model version {mv.version} of {model} ({key})")
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {
        "flyroll.workflow": "retrain", "flyroll.retrain.start": start.key,
        "flyroll.retrain.champion_before": start.model_version})
    return start


def _measured_at_start(spec: RunSpec) -> float | None:
    """eval/accuracy this run measured for its start policy (step 0), or None."""
    hist = tracking.client(spec.tracking_uri).get_metric_history(spec.mlflow_run_id, "eval/accuracy")
    at0 = sorted((m.timestamp, m.value) for m in hist if m.step == 0)
    return at0[0][1] if at0 else None


@task(**task_resources("promotion"))
def promote(spec: RunSpec, trained: PolicyRef, accuracy: float, champion: PolicyRef, dataset: DatasetRef) -> Decision:
    """Move the champion alias to `trained` iff its eval accuracy beats the champion's score; record both scores."""
    measured = _measured_at_start(spec)
    recorded = recorded_score(spec, champion, dataset)
    score, source = (recorded, "recorded") if recorded is not None else (measured, "measured at iteration 0")
    if score is None:
        raise ValueError(f"no score for the champion {champion.key}: neither a recorded flyroll.eval_accuracy on the "
                         f"{dataset.eval_key} split nor an eval/accuracy at step 0 of MLflow run {spec.mlflow_run_id}")
    promoted = decide(spec, trained, accuracy, champion, score, source, dataset, prefix="flyroll.retrain",
                      extra={"flyroll.retrain.champion_accuracy_measured": "" if measured is None else f"{measured:.6g}"})
    return Decision(trained=trained, champion=trained if promoted else champion, promoted=promoted)


def recorded_score(spec: RunSpec, champion: PolicyRef, dataset: DatasetRef) -> float | None:
    """The champion's score recorded on its model version (`flyroll.eval_accuracy`) when it was measured on
    `dataset`'s eval split (`flyroll.eval_dataset`), else None."""
    if not champion.model_version:
        return None
    tags = tracking.model_version(spec.tracking_uri, config_of(spec).run.registered_model, champion.model_version).tags
    if tags.get("flyroll.eval_accuracy") and tags.get("flyroll.eval_dataset") == dataset.eval_key:
        return float(tags["flyroll.eval_accuracy"])
    return None


def decide(spec: RunSpec, trained: PolicyRef, accuracy: float, champion: PolicyRef, score: float | None, source: str,
           dataset: DatasetRef, prefix: str, extra: dict | None = None) -> bool:
    """Promote `trained` (move the champion alias to its model version) iff it is a new registered version and
    its eval `accuracy` beats the champion's `score` (None: no champion yet, so any new version wins). Both
    scores and the decision become tags of the new model version and of the run (`prefix`.*). Returns
    whether it was promoted."""
    model, alias = config_of(spec).run.registered_model, config_of(spec).run.champion_alias
    new = trained.key != champion.key and bool(trained.model_version)
    promoted = new and (score is None or accuracy > score)
    shown = "none" if score is None else f"{score:.6g}"
    scores = {"flyroll.eval_accuracy": f"{accuracy:.6g}", "flyroll.eval_dataset": dataset.eval_key,
              "flyroll.champion_eval_accuracy": shown, "flyroll.champion_score_source": source,
              "flyroll.champion_model_version": champion.model_version, "flyroll.promoted": str(promoted).lower()}
    if new:
        tracking.set_model_version_tags(spec.tracking_uri, model, trained.model_version, scores)
    if promoted:
        tracking.set_alias(spec.tracking_uri, model, alias, trained.model_version)
    after = trained if promoted else champion
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {
        f"{prefix}.candidate_accuracy": f"{accuracy:.6g}", f"{prefix}.champion_accuracy": shown,
        f"{prefix}.champion_score_source": source, f"{prefix}.candidate": trained.key,
        f"{prefix}.candidate_model_version": trained.model_version,
        f"{prefix}.decision": "promoted" if promoted else "kept", f"{prefix}.champion_after": after.model_version,
        **(extra or {})})
    verdict = (f"[bold green]promoted[/] model version {trained.model_version} to {alias}" if promoted
               else f"[bold yellow]kept[/] {alias} {champion.model_version or '(none: base model)'}")
    console.print(f"{prefix.split('.')[-1]}: eval/accuracy {accuracy:.3f} vs champion {shown} ({source}) → {verdict}")
    return promoted


@workflow
def retrain(config: str = "", iterations: int = 4, set: typing.List[str] = []) -> RetrainOut:  # noqa: A002,B006
    """Retrain from the champion.

    Args:
        config: YAML preset (default configs/tiny.yaml)
        iterations: RL iterations to run (0 = only re-evaluate the champion)
        set: overrides of the preset, one JSON list of "dotted.key=value" items, values read as YAML,
            e.g. '["training.lr=1e-5"]'
    """
    spec, model_spec = prepare_run(config=config, restart=True, overrides=set)  # always a new run
    start = current_champion(spec=spec, model_spec=model_spec)            # champion, else the base model
    dataset = make_dataset(spec=spec, base=start)                         # the config's dataset snapshot
    _, eval_every = loop_bounds(spec=spec)
    out = rl_loop(spec=spec, origin=start, start=start, reference=start, dataset=dataset, last=iterations, eval_every=eval_every)
    decision = promote(spec=spec, trained=out.policy, accuracy=out.accuracy, champion=start, dataset=dataset)
    final = finalize(spec=spec, policy=decision.trained, final_accuracy=out.accuracy, samples=out.samples)
    return RetrainOut(policy=final, champion=decision.champion, promoted=decision.promoted)


def retrain_plan(name: str, config: str, cron: str, iterations: int = 4, overrides: typing.Sequence[str] = ()) -> LaunchPlan:
    """A launch plan `name` that runs `retrain` with preset `config` (a path relative to the code's
    root in the task image, as `pyflyte run --config` takes it) and `overrides` ("dotted.key=value"
    items, as `--set` takes them) on the cron schedule `cron` (UTC; five fields or @daily-style). The
    preset and overrides are loaded here, so a missing file or a bad field fails the package or
    register command, not the first scheduled run. Each project on one MLflow server gives its
    preset its own run.model_name (or run.experiment), so its champion is its own."""
    if iterations < 0:
        raise ValueError(f"retrain_plan {name!r}: iterations={iterations}; expected 0 or more")
    load_config(ROOT / config, list(overrides))   # an absolute path stays as it is
    return LaunchPlan.get_or_create(workflow=retrain, name=name, schedule=CronSchedule(schedule=cron),
                                    default_inputs={"config": config, "iterations": iterations, "set": list(overrides)})


# Nightly at 03:00 UTC against the shared stack (configs/tiny_s3.yaml: S3 store, MLflow server from env).
nightly_retrain = retrain_plan("flyroll_nightly_retrain", "configs/tiny_s3.yaml", "0 3 * * *")
