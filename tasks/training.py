"""Training: one actor update (advantages -> policy loss + KL) in the training actor, and a critic
update for PPO with GAE; writes the new checkpoint (weights + tokenizer + optimizer and objective
state, the critic under critic/) and the stage metrics, not the table."""

from __future__ import annotations

import os
import tempfile

import pandas as pd
import ray
from flytekit import task
from flytekit.types.directory import FlyteDirectory

from infra.ray_session import actor_pool, is_local_execution
from infra.resources import actor_options, ray_job, task_resources
from tasks.common import check_columns, config_of, stage
from tasks.types import PolicyRef, RunSpec
from tasks.workers import TrainWorker


def policy_key(spec: RunSpec, version: int) -> str:
    return f"runs/{spec.run_id}/policy/v{version:04d}"


@task(task_config=ray_job("training"), **task_resources("training"))
def train(spec: RunSpec, batch: pd.DataFrame, policy: PolicyRef, iteration: int) -> FlyteDirectory:
    """Returns the new checkpoint directory (published by weight_sync)."""
    check_columns(batch, "rollout", "scoring", "reference")
    cfg = config_of(spec)
    metrics: dict[str, float] = {}
    with stage(spec, "training", iteration, metrics):
        (worker,) = actor_pool(TrainWorker, "training", 1, spec.run_id, {"threads": cfg.run.torch_threads},
                               actor_options("training", is_local_execution()))
        tcfg, acfg = cfg.training.model_dump(), cfg.algorithm.model_dump()
        ray.get(worker.load.remote(spec, policy.key, tcfg, acfg))
        train_actor = acfg["advantage"] != "gae" or iteration > acfg["critic_warmup_iterations"]
        step_metrics, files = ray.get(
            worker.step.remote(batch, acfg, tcfg, cfg.rollout.temperature or 1.0,
                               cfg.run.seed * 7919 + iteration, policy_key(spec, iteration), train_actor)
        )
        metrics.update(step_metrics)
        out = tempfile.mkdtemp(prefix=f"flyroll-ckpt-{iteration:04d}-")
        for rel, data in files.items():
            path = os.path.join(out, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    return FlyteDirectory(out)
