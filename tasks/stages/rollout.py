"""Rollout: sample G responses for each of B prompts with the current policy, in generation actors.

With dynamic sampling (`algorithm.filter_groups`, DAPO) this task runs the rollout scheduler
(engines/generation/scheduler.py, through tasks/loop/prompts.py `dynamic_sampling`): chunks of prompts go to the
generation actors (tasks/actors/pools.py `RayGeneration`), each generated group to the reward workers at once, and the
batch fills with groups that pass the filters. That needs the generation actors, and they live
here, on the Ray cluster sized for them (infra/resources.py `hosted_roles`). The table then leaves
this task scored, and the scoring task passes it through. `rollout.score_while_generating` takes the
same path without filters: the batch is the rollout's own B prompts, in chunks of
`rollout.chunk_prompts`, each group scored while later chunks generate."""

from __future__ import annotations

import pandas as pd
import ray
from flytekit import task

from engines.data.prompt_mix import mix_domains, split_by_domain
from infra import tracking
from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.run.common import check_columns, config_of, stage
from tasks.loop.partial_rollout import partial_batch
from tasks.actors.pools import RayGeneration, generation_pool, sample_groups
from tasks.loop.prompts import dynamic_sampling, iteration_prompts, read_table
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.run.seeds import prompt_mix_seed, rollout_seed


OFFLOAD_LEVELS = {"none": 0, "cache": 1, "weights": 2}  # placement.offload_generation -> engine sleep level


@task(task_config=ray_job("rollout"), **task_resources("rollout"))
def rollout(spec: RunSpec, policy: PolicyRef, dataset: DatasetRef, iteration: int) -> pd.DataFrame:
    """B prompts x G samples -> one row per sample with token ids and behaviour log-probs; with
    `algorithm.filter_groups` also scored (reward, reward_error), B groups that pass the filters
    (fewer when the prompt budget runs out; see tasks/loop/prompts.py `dynamic_sampling`); with
    `rollout.score_while_generating` the B groups, scored; with `rollout.partial_rollout_max_split` > 1
    the B oldest complete groups of the pool carried from iteration-1 and new prompts, generated in
    segments (tasks/loop/partial_rollout.py)."""
    cfg = config_of(spec)
    r = cfg.rollout
    metrics: dict[str, float] = {}
    with stage(spec, "rollout", iteration, metrics):
        metrics["rollout/staleness"] = float(iteration - 1 - policy.version)  # updates behind the trainer's policy
        train = read_table(spec, dataset.train_key)
        if cfg.data.domain_weights:  # per-domain quotas every batch (ROLL's domain_interleave_probs)
            prompts = mix_domains(split_by_domain(train), dict(cfg.data.domain_weights), r.prompts_per_iteration,
                                  seed=prompt_mix_seed(cfg.run.seed, iteration)).reset_index(drop=True)
        elif r.partial_rollout_max_split == 1:
            prompts = iteration_prompts(train, r.prompts_per_iteration, iteration, cfg.run.seed)
        workers = generation_pool(spec, policy)
        if r.partial_rollout_max_split > 1:  # carried samples + the prompt stream, in segments (tasks/loop/partial_rollout.py)
            df, m = partial_batch(spec, workers, policy, train, iteration)
            metrics.update(m)
        elif cfg.scores_in_rollout:  # DAPO, or score_while_generating: the scheduler over these actors and the reward workers
            df, m = dynamic_sampling(spec, RayGeneration(spec, workers, policy.version, iteration,
                                                         rollout_seed(cfg.run.seed, iteration)), prompts, train, iteration)
            metrics.update(m)
        else:
            df = sample_groups(spec, workers, prompts, policy.version, iteration, rollout_seed(cfg.run.seed, iteration))
        offload = OFFLOAD_LEVELS[cfg.placement.offload_generation]
        if offload:  # free generation memory for the colocated trainer; load / live sync wakes the engines
            ray.get([w.sleep.remote(offload, f"placement.offload_generation={cfg.placement.offload_generation}")
                     for w in workers])
        check_columns(df, "rollout", *(("scoring",) if cfg.scores_in_rollout else ()), at="leaving rollout")
        lengths = df["response_token_ids"].map(len)
        metrics.update({
            "rollout/samples": float(len(df)), "rollout/response_length": float(lengths.mean()),
            "rollout/truncated_frac": float((df["finish_reason"] == "length").mean()),
            "rollout/tokens": float(lengths.sum()),
            **{f"rollout/mix/{k}": v for k, v in df["domain"].value_counts(normalize=True).items()},
        })
    metrics_tps = metrics["rollout/tokens"] / max(metrics["timing/rollout_s"], 1e-9)
    tracking.log_metrics(spec.tracking_uri, spec.mlflow_run_id, {"rollout/tokens_per_s": metrics_tps}, step=iteration)
    return df
