"""Weight sync: publish the new policy version and make the generators serve it.

Publish = register the checkpoint as an MLflow model version with lineage tags, then upload it to
the artifact store (data first, MANIFEST.json with sha256 per file, the parent version and the model
version last). Registering first, idempotently (found by its store key when it exists), means a
sync killed between the two steps is completed by the resumed iteration, and a published version
always has its model version. The next rollout loads exactly that version; on a local run the live
generation actors are told to update their weights in place right away (no engine restart).
"""

from __future__ import annotations

import os
import time
import typing

import ray
from flytekit import task
from flytekit.types.directory import FlyteDirectory

from configs.checks import tagged_kind
from infra import tracking
from infra.ray_session import shared_local_ray
from infra.resources import task_resources
from infra.store import ArtifactNotFound, CorruptArtifact
from tasks.run.checkpoints import discard_scratch_checkpoint
from tasks.run.common import TRAINER_STATE, config_of, execution_id, iteration_run, stage, store_of
from tasks.run.keys import policy_key, rollout_table_key
from tasks.actors.pools import generation_pool
from tasks.loop.publish_plan import UNPUBLISHED, publish_due, unpublished_since
from tasks.run.replay import DEFERRED
from tasks.run.types import DatasetRef, PolicyRef, RunSpec


@task(**task_resources("weight_sync"))
def publish_weights(spec: RunSpec, checkpoint: FlyteDirectory, parent: PolicyRef, dataset: DatasetRef, iteration: int,
                    actor_kept: typing.Optional[bool] = None, kind: str = "rl") -> PolicyRef:
    """`actor_kept`: whether the training actors live on to train iteration+1, as `train` was told
    (tasks/stages/fused.py passes it; None = a local run's shared Ray instance). With
    checkpoint.publish_every > 1 it decides, as in `train`, whether this version is published at all
    (tasks/loop/publish_plan.py); a skipped one returns its key unpublished. `kind` "sft" or "dpo"
    (tasks/stages/post_training.py): every version is published, with no rollout table (its metadata
    and tags say `kind` instead), and no generation actor is updated. An RL version of on-policy
    distillation carries its rollout table and kind "on_policy_distill"."""
    cfg = config_of(spec)
    kept = shared_local_ray() if actor_kept is None else actor_kept
    rl = kind == "rl"
    shown = tagged_kind(cfg, kind)   # an RL run with advantage on_policy_distill says so (configs/checks.py)
    if rl and not publish_due(iteration, cfg.checkpoint.publish_every, cfg.loop.iterations, cfg.loop.eval_every, kept):
        return _skip(spec, checkpoint, parent, iteration)
    metrics: dict[str, float] = {}
    started = time.time()  # in the manifest: a resume after a kill past the publish logs the stage's time (tasks/run/common.py)
    with stage(spec, "weight_sync", iteration, metrics):
        local = checkpoint.download()
        key = policy_key(spec, iteration)
        store = store_of(spec)
        rollouts = rollout_table_key(spec, iteration)
        # publish_every > 1: the parent in the store is the newest published ancestor; the skipped
        # versions between are named with their rollout tables (lineage stays whole)
        ancestor, skipped = unpublished_since(store, spec, parent.key)
        # from the store when the parent is not the one the caller knows (or was published in the
        # background: tasks/stages/fused.py hands on its key before the publish ends)
        parent_model_version = parent.model_version if ancestor == parent.key and parent.model_version else \
            store.manifest(ancestor).metadata.get("model_version", parent.model_version if ancestor == parent.key else "")
        child = iteration_run(spec, iteration, {"flyroll.policy_in": parent.key, "flyroll.policy_out": key,
                                                "flyroll.policy_in_model_version": parent_model_version})
        lineage = {
            "flyroll.run_id": spec.run_id, "flyroll.iteration": str(iteration), "flyroll.config_hash": spec.config_hash,
            "flyroll.parent": ancestor, "flyroll.parent_model_version": parent_model_version,
            "flyroll.dataset": dataset.train_key, "flyroll.eval_dataset": dataset.eval_key,
            **({"flyroll.rollout_table": rollouts} if rl else {}), "flyroll.kind": shown,
            "flyte.execution_id": execution_id(), "flyroll.child_run_id": child,
            **({"flyroll.unpublished": ",".join(str(s["iteration"]) for s in skipped)} if skipped else {}),
        }
        version = tracking.register_policy(spec.tracking_uri, config_of(spec).run.registered_model, spec.mlflow_run_id, store.uri(key), key, lineage)
        if not os.path.isdir(local) or not os.listdir(local):
            raise RuntimeError(f"publish_weights: iteration {iteration}'s checkpoint {checkpoint.path} is empty, but "
                               f"checkpoint.publish_every={cfg.checkpoint.publish_every} makes v{iteration} due: training "
                               "and weight sync disagree on actor_kept")
        every = config_of(spec).checkpoint.optimizer_every
        deferred = {} if os.path.exists(os.path.join(local, TRAINER_STATE)) else \
            {DEFERRED: f"checkpoint.optimizer_every={every}: kept by the training actor"}  # tasks/run/replay.py
        manifest = store.publish(local, key, kind="checkpoint", producer="publish_weights", parents=[ancestor],
                                 execution_id=execution_id(),
                                 metadata={"iteration": iteration, "config_hash": spec.config_hash, "dataset": dataset.train_key,
                                           **({"rollout_table": rollouts} if rl else {}), **({"kind": shown} if shown != "rl" else {}),
                                           "model_version": version,
                                           "registered_model": config_of(spec).run.registered_model,
                                           "mlflow_run_id": spec.mlflow_run_id, "mlflow_child_run_id": child,
                                           "weight_sync_started": started, **deferred,
                                           **({UNPUBLISHED: skipped} if skipped else {})})
        prune_trainer_states(store, spec, iteration, config_of(spec).run.keep_trainer_states)
        tracking.set_tags(spec.tracking_uri, child, {"flyroll.model_version": version})
        tracking.end_run(spec.tracking_uri, child)  # the iteration is committed; its evaluation may still log into it
        metrics["weight_sync/bytes"] = float(sum(f.size for f in manifest.files.values()))
        metrics["weight_sync/published"] = 1.0
        # live path: the generators on this process's Ray cluster take the new weights in place -- a
        # local run's shared instance, or the one cluster of fused iterations (tasks/stages/fused.py); not a
        # per-task stage's cluster, which is gone by now (this task is not a Ray task)
        # (with pipeline.off_policy_steps the generators serve an older version: each rollout loads its own)
        # (sync.method=live: the training stage already sent them these weights, tasks/loop/live_sync.py)
        if rl and ray.is_initialized() and config_of(spec).pipeline.off_policy_steps == 0 and config_of(spec).sync.method == "store":
            try:
                generation_pool(spec, PolicyRef(key=key, version=iteration))
            except ValueError:
                pass
    discard_scratch_checkpoint(checkpoint.path)
    return PolicyRef(key=key, version=iteration, model_version=version)


def _skip(spec: RunSpec, checkpoint: FlyteDirectory, parent: PolicyRef, iteration: int) -> PolicyRef:
    """checkpoint.publish_every: version `iteration` is not published (the training actor holds it and
    the generators serve it by live sync). Its MLflow child run is tagged so and closed; the next
    published version names it (tasks/loop/publish_plan.py)."""
    key = policy_key(spec, iteration)
    with stage(spec, "weight_sync", iteration, {"weight_sync/published": 0.0}):
        child = iteration_run(spec, iteration, {"flyroll.policy_in": parent.key, "flyroll.policy_out": key,
                                                "flyroll.published": "false"})
        tracking.end_run(spec.tracking_uri, child)
    discard_scratch_checkpoint(checkpoint.path)
    return PolicyRef(key=key, version=iteration, model_version="")


def prune_trainer_states(store, spec: RunSpec, iteration: int, keep: int) -> str | None:
    """Drop trainer_state.pt (optimizer moments, LR schedule, objective state: 2/3 of a checkpoint)
    from the versions that hold one beyond the newest `keep` that do, once `iteration` is published.

    Counted among the versions that hold it, not by iteration: with checkpoint.optimizer_every > 1
    the versions after the newest holder are deferred and a resume replays them from it
    (tasks/run/replay.py), so the newest holder is never pruned (keep >= 1). Only a publish that holds
    its state can make one too many, so a deferred one prunes nothing. Walks back through the
    manifests until a version already pruned (older ones were dealt with by earlier publishes) or
    the run's first, past the versions never published (checkpoint.publish_every). Returns the
    newest key pruned, if any."""
    def holds(version: int) -> bool | None:  # None: stop (unreadable or already pruned)
        try:
            m = store.manifest(policy_key(spec, version))
        except ArtifactNotFound:  # not published (checkpoint.publish_every): walk on past it
            return False
        except CorruptArtifact:
            return None
        return True if TRAINER_STATE in m.files else (None if TRAINER_STATE in m.metadata.get("pruned", {}) else False)

    if holds(iteration) is not True:
        return None
    held, newest = 1, None
    for old in range(iteration - 1, 0, -1):
        h = holds(old)
        if h is None:
            break
        held += h
        if h and held > keep:
            store.prune(policy_key(spec, old), [TRAINER_STATE], reason=f"run.keep_trainer_states={keep}")
            newest = newest or policy_key(spec, old)
    return newest
