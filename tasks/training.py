"""Training: one actor update (advantages -> policy loss + KL) in the training actor, and a critic
update for PPO with GAE; writes the new checkpoint (weights + tokenizer + optimizer and objective
state, the critic under critic/) and the stage metrics, not the table.

With `training.strategy` other than torch, `training.num_workers` TrainWorker actors in the task's
Ray cluster form one torch.distributed group (rank 0's actor gives the rendezvous address); each gets
the whole table (one object in the Ray store) and trains on its shard of every mini-batch; rank 0
returns the checkpoint."""

from __future__ import annotations

import os
import tempfile

import pandas as pd
import ray
from flytekit import task
from flytekit.types.directory import FlyteDirectory

from infra.ray_session import actor_pool, shared_local_ray
from infra.resources import actor_options_for, ray_job, role_devices, task_resources
from tasks.common import check_columns, config_of, stage
from tasks.types import PolicyRef, RunSpec
from tasks.workers import TrainWorker


def policy_key(spec: RunSpec, version: int) -> str:
    return f"runs/{spec.run_id}/policy/v{version:04d}"


CHECKPOINT_SCRATCH_PREFIX = "flyroll-ckpt-"


def train_workers(cfg, run_id: str) -> list:
    """The run's TrainWorker actors; with a distributed strategy, joined into one process group."""
    t = cfg.training
    workers = actor_pool(TrainWorker, "training", t.num_workers, run_id,
                         {"threads": cfg.run.torch_threads, "devices": role_devices(cfg, "actor_train", "critic")},
                         actor_options_for(cfg, "actor_train", shared_local_ray()))
    if t.strategy != "torch":
        address = ray.get(workers[0].rendezvous.remote())
        ray.get([w.join_group.remote(rank, len(workers), address) for rank, w in enumerate(workers)])
    return workers


@task(task_config=ray_job("training"), **task_resources("training"))
def train(spec: RunSpec, batch: pd.DataFrame, policy: PolicyRef, iteration: int) -> FlyteDirectory:
    """Returns the new checkpoint directory (published by weight_sync)."""
    check_columns(batch, "rollout", "scoring", "reference", at="entering training")
    cfg = config_of(spec)
    metrics: dict[str, float] = {}
    with stage(spec, "training", iteration, metrics):
        workers = train_workers(cfg, spec.run_id)
        tcfg, acfg = cfg.training.model_dump(), cfg.algorithm.model_dump()
        ray.get([w.load.remote(spec, policy.key, tcfg, acfg) for w in workers])
        train_actor = acfg["advantage"] != "gae" or iteration > acfg["critic_warmup_iterations"]
        table = batch if len(workers) == 1 else ray.put(batch)  # every rank reads the one stored copy
        out = tempfile.mkdtemp(prefix=f"{CHECKPOINT_SCRATCH_PREFIX}{iteration:04d}-")  # removed by publish_weights
        here = (ray.get_runtime_context().get_node_id(), out)  # rank 0 on this node writes into `out` itself
        (step_metrics, files), *_ = ray.get(
            [w.step.remote(table, acfg, tcfg, cfg.rollout.temperature or 1.0, cfg.run.seed * 7919 + iteration,
                           policy_key(spec, iteration), train_actor, here) for w in workers]
        )
        metrics.update(step_metrics)
        metrics["training/workers"] = float(len(workers))
        for rel, data in files.items():  # rank 0 on another node: its files came back as bytes
            path = os.path.join(out, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    return FlyteDirectory(out)
