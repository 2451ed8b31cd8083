"""`loop.fuse: N`: N iterations, with their evaluations, inside one Flyte task on one Ray cluster.

Each stage task of workflows/rlvr.py runs on its own Ray cluster. On a Flyte cluster that costs,
per stage and iteration, a Ray cluster start, the engine actors' start and a model load from the
store. The fused task runs the same stage bodies, in the same recipe (tasks/loop/recipe.py), one after another on one cluster that holds every
stage's nodes (`infra.resources.fused_ray_job`): the engine actors are created once, stay warm, and
the generators take each new policy in place (tasks/stages/weight_sync.py, `ray.is_initialized()`).
Nothing else changes: every iteration publishes its policy (with `checkpoint.publish_every` > 1 only the due ones) and rollout table, registers the model
version and logs its MLflow child run exactly as the separate tasks do, so lineage and resume are
those of the unfused loop, and with the same seeds the results are the same
(tests/e2e/test_workflow.py `test_fused_iterations_give_the_same_run_in_one_task`). With
`checkpoint.optimizer_every` > 1 the last iteration of the task publishes its trainer state whatever
the rule says of the others (on a Flyte cluster the task's actors end with it); likewise with
`checkpoint.publish_every` > 1 the last iteration of the task is published (tasks/loop/publish_plan.py).

Between stages the rollout table goes through parquet, as it does between tasks (Flyte's
StructuredDataset), so every stage reads exactly the table it would read unfused.

With `sync.method: live` the generators never wait for the store, so the publish of a due version
(every version, or every `checkpoint.publish_every`-th) runs in a background thread overlapping the
next iteration: one in flight, joined before the next publish (its lineage reads the store), before
an evaluation and at the task's end; a failure is re-raised there naming the version.

With `pipeline.off_policy_steps` > 0 the next iteration's sampler is published before this
iteration's update starts, so the fused task samples the next iteration's rollout in a thread on
the generation actors while this iteration scores, runs the reference forward and trains on the
other actors: generation and training at the same time, each on its own cores. The rollout is
waited for before an evaluation (which loads its policy into the same generation actors).
"""

from __future__ import annotations

import io
import typing
from concurrent.futures import Future, ThreadPoolExecutor

import pandas as pd
from flytekit import task

from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.run.common import config_of
from tasks.stages.evaluation import evaluate
from tasks.run.keys import policy_key
from tasks.loop.publish_plan import BackgroundPublish, publish_due
from tasks.loop.recipe import Stages, generator_policy, one_iteration, run_iterations
from tasks.stages.reference import reference_forward
from tasks.stages.rollout import rollout
from tasks.stages.scoring import score
from tasks.stages.training import train
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.stages.weight_sync import publish_weights

FusedOut = typing.NamedTuple("FusedOut", [("policy", PolicyRef), ("accuracy", float), ("samples", pd.DataFrame)])


def _between_tasks(df: pd.DataFrame) -> pd.DataFrame:
    """The table as the next task would receive it: written to parquet and read back."""
    buf = io.BytesIO()
    df.to_parquet(buf)
    return pd.read_parquet(io.BytesIO(buf.getvalue()))


@task(task_config=ray_job("fused"), **task_resources("fused"))
def fused_iterations(spec: RunSpec, origin: PolicyRef, policy: PolicyRef, reference: PolicyRef, dataset: DatasetRef,
                     first: int, count: int, last: int, eval_every: int) -> FusedOut:
    """Iterations first..first+count-1 from `policy` (of the run that began at `origin`); returns the
    last policy, the accuracy of the last evaluation in the chunk (-1.0 when none), and the last
    iteration's scored table."""
    cfg = config_of(spec)
    lag = cfg.pipeline.off_policy_steps
    end = first + count - 1
    versions: dict = {}  # this chunk's policies by version (tasks/loop/recipe.py `run_iterations` fills it)
    # with a lag the next iteration's sampler is already published, so its rollout runs on the
    # generation actors while this iteration scores, runs the reference forward and trains
    ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyroll-rollout") if lag > 0 else None
    pending: dict[int, Future] = {}  # the next iteration's rollout, sampled ahead

    def sample(generator: PolicyRef, it: int) -> pd.DataFrame:
        return _between_tasks(rollout.task_function(spec=spec, policy=generator, dataset=dataset, iteration=it))

    def rollout_ahead(spec: RunSpec, policy: PolicyRef, dataset: DatasetRef, iteration: int) -> pd.DataFrame:
        batch = pending.pop(iteration).result() if iteration in pending else sample(policy, iteration)
        if ahead is not None and iteration < end:
            pending[iteration + 1] = ahead.submit(sample, generator_policy(spec, origin, versions, iteration + 1, lag),
                                                  iteration + 1)
        return batch

    # sync.method live: the generators never wait for the store, so a due version's publish runs in
    # the background, overlapping the next iteration (tasks/loop/publish_plan.py `BackgroundPublish`)
    behind = BackgroundPublish() if cfg.sync.method == "live" else None

    def publish(**kw) -> PolicyRef:
        it, kept = kw["iteration"], kw["iteration"] < end  # the last of the task is published
        if behind is None:
            return publish_weights.task_function(**kw, actor_kept=kept)
        behind.join()  # one in flight; the next one's lineage reads the store (tasks/loop/publish_plan.py)
        if not publish_due(it, cfg.checkpoint.publish_every, cfg.loop.iterations, cfg.loop.eval_every, kept):
            return publish_weights.task_function(**kw, actor_kept=kept)  # skipped: nothing to upload
        behind.submit(it, publish_weights.task_function, **kw, actor_kept=kept)
        return PolicyRef(key=policy_key(spec, it), version=it)  # the model version comes with the join

    def evaluate_after(policy: PolicyRef) -> float:
        for f in pending.values():
            f.result()  # the evaluation loads its policy into the same generation actors
        if behind is not None:
            policy = behind.published(policy)  # in the store, with its model version, before it is evaluated
        return evaluate.task_function(spec=spec, policy=policy, dataset=dataset)

    stages = Stages(
        rollout=rollout_ahead,
        score=lambda **kw: _between_tasks(score.task_function(**kw)),
        reference_forward=lambda **kw: _between_tasks(reference_forward.task_function(**kw)),
        # the training actors live on to the next iteration of this task; the last one's checkpoint
        # holds the trainer state (checkpoint.optimizer_every: tasks/run/replay.py)
        train=lambda **kw: train.task_function(**kw, actor_kept=kw["iteration"] < end),
        publish_weights=publish)
    try:
        state = run_iterations(
            step=lambda p, generator, it: one_iteration(stages, spec, p, generator, reference, dataset, it),
            evaluate=evaluate_after, spec=spec, origin=origin, start=policy, first=first, end=end, last=last,
            eval_every=eval_every, lag=lag, versions=versions)
        if behind is not None:
            state = state._replace(policy=behind.published(state.policy))  # joined at the task's end
        return FusedOut(*state)
    finally:
        if ahead is not None:
            ahead.shutdown(wait=True, cancel_futures=True)
        if behind is not None:
            behind.close()
