"""Evaluation (greedy and sampled pass@k, fixed eval split) and the end of a run: summary, report deck, Ray shutdown."""

from __future__ import annotations

import os

import pandas as pd
import ray
from flytekit import task

from engines.data.datasets import encode_nested
from engines.rewards.evaluation import eval_metrics, sampled_metrics
from infra import decks, lineage, tracking
from infra.ray_session import is_local_execution, shutdown
from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.run.common import config_of, console, stage, store_of
from tasks.actors.pools import check_reward_errors, generation_pool, score_table
from tasks.loop.prompts import read_table
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.run.seeds import eval_sampling_seed




@task(task_config=ray_job("evaluation"), **task_resources("evaluation"))
def evaluate(spec: RunSpec, policy: PolicyRef, dataset: DatasetRef) -> float:
    """Greedy accuracy of `policy` on the eval split; logs eval/accuracy, eval/reward (+ per domain and
    reasoning-gym generator) at step=policy.version, and with loop.eval_samples = k, eval/pass_at_k and
    eval/sampled_accuracy. Rows are scored by the scoring stage's own `score_table` (the run's reward
    workers, routing and model rewards), so eval gives each row the reward training would."""
    cfg = config_of(spec)
    metrics: dict[str, float] = {}
    with stage(spec, "evaluation", policy.version, metrics):
        table = read_table(spec, dataset.eval_key)
        workers = generation_pool(spec, policy)
        args = (table, cfg.rollout.max_new_tokens, cfg.model.apply_chat_template, tuple(cfg.rollout.stop))
        rows = _scored(spec, ray.get(workers[0].eval_responses.remote(*args)))
        result = eval_metrics(rows)
        tracking.log_text(spec.tracking_uri, spec.mlflow_run_id, rows.to_csv(index=False), f"eval/v{policy.version:04d}.csv")
        if k := cfg.loop.eval_samples:  # the same draws for every checkpoint: one seed per run
            sampled = _scored(spec, ray.get(workers[0].eval_responses.remote(*args, samples=k, temperature=cfg.rollout.temperature,
                                                                              seed=eval_sampling_seed(cfg.run.seed))))
            result.update(sampled_metrics(sampled, k))
            tracking.log_text(spec.tracking_uri, spec.mlflow_run_id, sampled.to_csv(index=False), f"eval/v{policy.version:04d}_sampled.csv")
        metrics.update({f"eval/{k}": v for k, v in result.items()})
    check_reward_errors(cfg.reward, rows, f"evaluation of version {policy.version}")   # after eval/* are logged
    return float(result["accuracy"])


def _scored(spec: RunSpec, rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` plus reward and reward_error from the scoring stage's own `score_table` (tasks/actors/pools.py)."""
    rewards, errors = score_table(spec, encode_nested(rows))  # tests/metadata as JSON text, as a rollout table
    rows["reward"] = rewards
    rows["reward_error"] = pd.Series(errors, index=rows.index, dtype=object)
    return rows


KEY_METRICS = ("eval/accuracy", "reward/mean", "eval/reward")  # first in report.html, linked from the run page


def _history(spec: RunSpec) -> dict[str, list[tuple[int, float]]]:
    c = tracking.client(spec.tracking_uri)
    run = c.get_run(spec.mlflow_run_id)
    keys = [k for k in run.data.metrics if k.startswith(("eval/accuracy", "eval/pass_at_", "eval/sampled_accuracy", "reward/mean", "reward/accuracy", "rollout/response_length", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac"))]
    out = {}
    # the key charts first (a reader's first question is "did it learn?"), then the rest by name
    for k in sorted(keys, key=lambda k: (KEY_METRICS.index(k) if k in KEY_METRICS else len(KEY_METRICS), k)):
        # one point per step (the first), also for runs logged before logging was idempotent
        first: dict[int, float] = {}
        for m in sorted(c.get_metric_history(spec.mlflow_run_id, k), key=lambda m: (m.step, m.timestamp)):
            first.setdefault(m.step, m.value)
        out[k] = sorted(first.items())
    return out


@task(enable_deck=True, **task_resources("report"))
def finalize(spec: RunSpec, policy: PolicyRef, final_accuracy: float, samples: pd.DataFrame) -> PolicyRef:
    """Summary metrics and tags, the report (Flyte Deck + HTML file + MLflow artifact), end of the MLflow
    run, and -- on a local run -- the end of the shared Ray instance."""
    cfg = config_of(spec)
    history = _history(spec)
    acc = history.get("eval/accuracy", [])
    timings = {}
    c = tracking.client(spec.tracking_uri)
    for k in c.get_run(spec.mlflow_run_id).data.metrics:
        if k.startswith("timing/"):
            vals = [m.value for m in c.get_metric_history(spec.mlflow_run_id, k)]
            timings[k.split("/", 1)[1].removesuffix("_s")] = sum(vals) / max(1, len(vals))
    summary: dict[str, float | str] = {"run": spec.run_id, "final policy": policy.key, "model version": policy.model_version}
    exp_id = c.get_run(spec.mlflow_run_id).info.experiment_id
    key_charts = lineage.key_charts(history, KEY_METRICS, exp_id, spec.mlflow_run_id)
    summary.update({k: gain for k, gain, _ in key_charts})
    rows = lineage.summary_rows(lineage.lineage(policy.key, spec.store_uri, spec.tracking_uri, config_of(spec).run.registered_model),
                                spec.config_hash)
    html = decks.report_html(title=f"flyroll {spec.run_id}", history=history, samples=samples if len(samples) else None,
                             timings=timings, summary=summary, lineage=rows)
    decks.publish_deck("flyroll report", html)
    path = decks.write_report(os.path.join(os.path.abspath(cfg.run.output_dir), spec.run_id, "report.html"), html)
    tracking.log_text(spec.tracking_uri, spec.mlflow_run_id, html, "report.html")
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.final_policy": policy.key, "flyroll.status": "complete",
                                                              "flyroll.final_model_version": policy.model_version,
                                                              tracking.NOTE: lineage.note_markdown(key_charts, rows)})
    tracking.end_run(spec.tracking_uri, spec.mlflow_run_id)
    store_of(spec).unlock_run(spec.run_id)  # the run lock prepare_run took (a killed run's: taken over by the next)
    console.print(f"[bold green]done[/] final policy {policy.key} (MLflow model version {policy.model_version or '-'})")
    if acc:
        console.print(f"eval/accuracy {acc[0][1]:.3f} (iteration {acc[0][0]}) → {acc[-1][1]:.3f} (iteration {acc[-1][0]})")
    console.print(f"report: {path}\nMLflow UI: {tracking.ui_links(spec.tracking_uri, exp_id, spec.mlflow_run_id)}")
    if is_local_execution():
        shutdown()
    return policy
