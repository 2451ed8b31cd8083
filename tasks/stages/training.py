"""Training: one actor update (advantages -> policy loss + KL) in the training actor, and a critic
update for PPO with GAE; writes the new checkpoint (weights + tokenizer + optimizer and objective
state, the critic under critic/) and the stage metrics, not the table. With
`checkpoint.optimizer_every` > 1 most checkpoints leave the optimizer and objective state out and the
training actor keeps it (tasks/run/replay.py says which, and how a resume rebuilds it).

With `training.strategy` other than torch, `training.num_workers` TrainWorker actors in the task's
Ray cluster form one torch.distributed group (rank 0's actor gives the rendezvous address); each gets
the whole table (one object in the Ray store) and trains on its shard of every mini-batch; rank 0
returns the checkpoint."""

from __future__ import annotations

import os
import typing

import pandas as pd
import ray
from flytekit import task
from flytekit.types.directory import FlyteDirectory

from infra.ray_session import shared_local_ray
from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.run.checkpoints import scratch_checkpoint_dir
from tasks.run.common import check_columns, config_of, stage
from tasks.actors.hybrid import train_workers
from tasks.run.keys import policy_key
from tasks.loop.live_sync import check_live_sync, live_sync
from tasks.loop.publish_plan import publish_due
from tasks.run.replay import trainer_state_due, update_args
from tasks.run.types import PolicyRef, RunSpec


@task(task_config=ray_job("training"), **task_resources("training"))
def train(spec: RunSpec, batch: pd.DataFrame, policy: PolicyRef, iteration: int,
          actor_kept: typing.Optional[bool] = None) -> FlyteDirectory:
    """Returns the new checkpoint directory (published by weight_sync). `actor_kept`: whether the
    training actors live on to train iteration+1 (tasks/stages/fused.py passes it); None = they do when the
    run shares one local Ray instance (`shared_local_ray`). With checkpoint.optimizer_every > 1 it
    decides, with the iteration, whether the checkpoint holds trainer_state.pt (tasks/run/replay.py); with
    checkpoint.publish_every > 1 whether a checkpoint is written at all (tasks/loop/publish_plan.py).
    With sync.method=live the trainer then sends the new weights to the generation actors
    (tasks/loop/live_sync.py) before the task returns."""
    check_columns(batch, "rollout", "scoring", "reference", at="entering training")
    cfg = config_of(spec)
    metrics: dict[str, float] = {}
    live = cfg.sync.method == "live"
    if live:
        check_live_sync(cfg, fused=actor_kept is not None)
    with stage(spec, "training", iteration, metrics):
        workers = train_workers(cfg, spec.run_id)
        loaded = ray.get([w.load.remote(spec, policy.key, cfg.training, cfg.algorithm) for w in workers])
        if loaded[0].startswith("replayed"):
            print(f"flyroll: training iteration {iteration}: {policy.key} {loaded[0]}", flush=True)
        kept = shared_local_ray() if actor_kept is None else actor_kept
        published = publish_due(iteration, cfg.checkpoint.publish_every, cfg.loop.iterations, cfg.loop.eval_every, kept)
        # publish_every > 1: a published version holds its trainer state (a resume starts from it), a
        # skipped one writes no checkpoint at all (this actor keeps both; tasks/loop/publish_plan.py)
        with_state = published if cfg.checkpoint.publish_every > 1 else \
            trainer_state_due(iteration, cfg.checkpoint.optimizer_every, cfg.loop.iterations, kept)
        args = update_args(cfg, iteration)
        table = batch if len(workers) == 1 else ray.put(batch)  # every rank reads the one stored copy
        out = scratch_checkpoint_dir(iteration)  # removed by publish_weights
        here = (ray.get_runtime_context().get_node_id(), out)  # rank 0 on this node (or machine) writes into `out` itself
        (step_metrics, files), *_ = ray.get(
            [w.step.remote(table, cfg.algorithm, cfg.training, args["temperature"], args["seed"], policy_key(spec, iteration),
                           args["train_actor"], here, with_state, live, published) for w in workers]
        )
        offload = cfg.placement.offload_train
        if cfg.placement.offload_generation != "none" or offload != "none":  # colocated generators wake next: give
            # them the step's memory and (offload_train) the trainer's state, the weights once a live sync has read them
            moved = ray.get([w.release_memory.remote(offload, live) for w in workers])[0]
        if live:  # the generators take the new weights now; weight_sync still publishes the checkpoint
            report = live_sync(spec, cfg, workers, iteration, policy_key(spec, iteration))
            if offload == "all":
                moved += ray.get([w.release_memory.remote(offload) for w in workers])[0]
            metrics.update({"weight_sync/live_seconds": report["seconds"], "weight_sync/live_bytes": float(report["bytes"]),
                            "weight_sync/live_buckets": float(report["buckets"]),
                            "weight_sync/live_in_process": float(report["transport"] == "in_process")})  # placement.hybrid
        if offload != "none":
            metrics["training/offloaded_mb"] = moved / 2**20
        metrics.update(step_metrics)
        metrics["training/trainer_state_published"] = float(with_state and published)
        metrics["training/checkpoint_written"] = float(published)
        metrics["training/workers"] = float(len(workers))
        for rel, data in files.items():  # rank 0 on another node: its files came back as bytes
            path = os.path.join(out, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    return FlyteDirectory(out)
