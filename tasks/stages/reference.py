"""Reference forward: reference-model log-probs (KL anchor), the current policy's log-probs
(`old_logprobs`, recomputed so the PPO ratio starts at exactly 1 whatever engine sampled) and, for
PPO with GAE (`algorithm.advantage: gae`), the values of this iteration's critic (the one published
with the policy checkpoint; at the first iteration a fresh one from the policy backbone).

The reference is the `reference` PolicyRef the workflow passes: `model.reference_path` when set
(imported and vocabulary-checked by tasks/stages/prepare.py `reference_policy`), else the starting policy.

Forwards that cannot change the update are skipped: with `algorithm.kl_coef: 0` the reference
model is not run (`ref_logprobs` = `old_logprobs`, so every KL term is exactly 0) unless the advantage
estimator reads it (`AlgorithmConfig.reference_needed`: on_policy_distill, whose reference is the teacher), and the policy
is not run with `algorithm.old_logprobs: behaviour`, nor with `auto` when the update is one
on-policy pass (`AlgorithmConfig.old_logprobs_in_update`: the trainer then takes π_old from its own
forward). Without the policy forward `old_logprobs` = the engine's `behaviour_logprobs`. The table
keeps the same columns either way."""

from __future__ import annotations

import os
import tempfile
import typing

import numpy as np
import pandas as pd
import ray
from flytekit import task

from engines.data.rollout_table import batch_from_table
from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.run.common import check_columns, config_of, execution_id, stage, store_of
from tasks.actors.hybrid import role_actors
from tasks.run.keys import rollout_table_key
from tasks.run.replay import update_args
from tasks.run.types import PolicyRef, RunSpec


@task(task_config=ray_job("reference"), **task_resources("reference"))
def reference_forward(spec: RunSpec, batch: pd.DataFrame, policy: PolicyRef, reference: PolicyRef, iteration: int,
                      generator: typing.Optional[PolicyRef] = None) -> pd.DataFrame:
    """Adds `ref_logprobs`, `old_logprobs` and, with a critic, `values` (lists aligned with
    `response_token_ids`). `policy` is the one the update starts from; `generator` the one that
    sampled the batch when that is an older version (pipeline.off_policy_steps; None = `policy`)."""
    check_columns(batch, "rollout", "scoring", at="entering reference_forward")
    cfg = config_of(spec)
    metrics: dict[str, float] = {}
    with stage(spec, "reference", iteration, metrics):
        (worker,) = role_actors(cfg, spec.run_id, "reference")
        models = {"reference": reference.key, "policy": policy.key}
        if not cfg.algorithm.reference_needed():
            models.pop("reference")
        if cfg.algorithm.old_logprobs == "behaviour" or cfg.algorithm.old_logprobs_in_update(
                len(batch), cfg.training.mini_batch_size):
            models.pop("policy")
        ray.get([worker.load.remote(role, spec, key) for role, key in models.items()])
        tensors = batch_from_table(batch, int(ray.get(worker.pad_id.remote())))  # the one conversion
        width = tensors.input_ids.shape[1] - tensors.responses.shape[1] + int(tensors.response_lengths.max())  # P + longest response
        mb = max(1, cfg.training.max_tokens_per_micro_batch // max(1, width))
        rows = ray.put(tensors)
        temperature = update_args(cfg, iteration)["temperature"]   # the update's: π_old, π_ref and π_θ alike
        computed = dict(zip(models, ray.get([worker.logprobs.remote(role, rows, mb, temperature) for role in models])))
        old_lp = computed.get("policy", [list(x) for x in batch["behaviour_logprobs"]])
        ref_lp = computed.get("reference", old_lp)
        metrics["reference/forwards"] = float(len(models))
        values = None
        if cfg.algorithm.advantage == "gae":
            ray.get(worker.load.remote("critic", spec, policy.key))
            values = ray.get(worker.values.remote(rows, mb))
            v = _flat(values)
            metrics["reference/values_mean"] = float(v.mean()) if v.size else 0.0
        if cfg.placement.offload_reference:  # the colocated generators and trainer run next: free the models
            ray.get(worker.release.remote())
        df = with_logprobs(batch, ref_lp, old_lp, values)
        check_columns(df, "rollout", "scoring", "reference", at="leaving reference_forward")
        metrics.update(logprob_metrics(batch, ref_lp, old_lp, policy_forward="policy" in models))
        publish_rollout_table(spec, df, generator or policy, iteration, reference.key if "reference" in models else None,
                              trainer=policy)
    return df


def logprob_metrics(batch: pd.DataFrame, ref_logprobs: list, old_logprobs: list, policy_forward: bool) -> dict[str, float]:
    """`reference/kl_k3` (mean k3 estimate of KL(π_old ‖ π_ref)) and, when the policy forward ran
    (`policy_forward`; else `old_logprobs` is the behaviour column itself and the trainer measures the
    gap), `reference/behaviour_logprob_diff` (max |π_old − behaviour|), over the tokens the loss sees:
    an agentic row's environment tokens (`loss_mask` 0) have no behaviour log-prob (the column holds
    0.0 there), so counting them would report the observations' log-probs as KL."""
    old, ref, beh = _flat(old_logprobs), _flat(ref_logprobs), _flat(batch["behaviour_logprobs"])
    keep = _flat(batch["loss_mask"]) > 0 if "loss_mask" in batch.columns else np.ones(old.size, dtype=bool)
    old, ref, beh = old[keep], ref[keep], beh[keep]
    if not old.size:
        return {}
    out = {"reference/kl_k3": float(np.mean(np.exp(ref - old) - (ref - old) - 1))}
    if policy_forward:
        out["reference/behaviour_logprob_diff"] = float(np.max(np.abs(beh - old)))
    return out


def _flat(rows) -> np.ndarray:
    """Per-row lists (one per response) as one float64 array."""
    return np.concatenate([np.asarray(x, dtype=np.float64) for x in rows] or [np.zeros(0)])


def with_logprobs(batch: pd.DataFrame, ref_logprobs: list, old_logprobs: list, values: list | None = None) -> pd.DataFrame:
    """A copy of `batch` with the reference stage's columns, one list per row aligned with
    `response_token_ids`: `ref_logprobs`, `old_logprobs` and, when given, the critic's `values`."""
    df = batch.copy()
    for name, col in (("ref_logprobs", ref_logprobs), ("old_logprobs", old_logprobs), ("values", values)):
        if col is not None:
            df[name] = pd.Series(list(col), index=df.index, dtype=object)
    return df


def publish_rollout_table(spec: RunSpec, df: pd.DataFrame, policy: PolicyRef, iteration: int, reference: str | None = None,
                          trainer: PolicyRef | None = None) -> str:
    """The complete rollout table of an iteration as a versioned artifact, first parent = the policy
    that sampled it, so any sample can be traced to the model version that produced it; `reference`
    (the key of the model behind `ref_logprobs`, None when no reference forward ran) is the second
    parent and `metadata.reference`; `trainer`, the policy the update starts from, when another
    (off-policy generation), is the last parent and `metadata.trained_from`."""
    key = rollout_table_key(spec, iteration)
    store = store_of(spec)
    if not store.exists(key):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rollout.parquet")
            df.to_parquet(path, index=False)
            parents = [policy.key] + ([reference] if reference and reference != policy.key else [])
            trained_from = trainer.key if trainer is not None and trainer.key != policy.key else None
            parents += [trained_from] if trained_from and trained_from not in parents else []
            store.publish_file(path, key, kind="rollout", producer="reference_forward", parents=parents,
                               execution_id=execution_id(),
                               metadata={"iteration": iteration, "rows": len(df), "reference": reference,
                                         **({"trained_from": trained_from} if trained_from else {})})
    return key
