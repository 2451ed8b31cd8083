"""`loop.fuse: N`: N iterations, with their evaluations, inside one Flyte task on one Ray cluster.

Each stage task of workflows/rlvr.py runs on its own Ray cluster. On a Flyte cluster that costs,
per stage and iteration, a Ray cluster start, the engine actors' start and a model load from the
store. The fused task runs the same stage bodies one after another on one cluster that holds every
stage's nodes (`infra.resources.fused_ray_job`): the engine actors are created once, stay warm, and
the generators take each new policy in place (tasks/weight_sync.py, `ray.is_initialized()`).
Nothing else changes: every iteration publishes its policy and rollout table, registers the model
version and logs its MLflow child run exactly as the separate tasks do, so lineage and resume are
those of the unfused loop, and with the same seeds the results are the same
(tests/test_workflow.py `test_fused_iterations_give_the_same_run_in_one_task`). With
`checkpoint.optimizer_every` > 1 the last iteration of the task publishes its trainer state whatever
the rule says of the others (on a Flyte cluster the task's actors end with it).

Between stages the rollout table goes through parquet, as it does between tasks (Flyte's
StructuredDataset), so every stage reads exactly the table it would read unfused.

With `pipeline.off_policy_steps` > 0 the next iteration's sampler is published before this
iteration's update starts, so the fused task samples the next iteration's rollout in a thread on
the generation actors while this iteration scores, runs the reference forward and trains on the
other actors: generation and training at the same time, each on its own cores. The rollout is
waited for before an evaluation (which loads its policy into the same generation actors).
"""

from __future__ import annotations

import io
import typing

import pandas as pd
from flytekit import task

from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.evaluation import evaluate
from tasks.reference import reference_forward
from tasks.rollout import rollout
from tasks.scoring import score
from tasks.training import train
from tasks.types import DatasetRef, PolicyRef, RunSpec
from tasks.weight_sync import publish_weights

FusedOut = typing.NamedTuple("FusedOut", [("policy", PolicyRef), ("accuracy", float), ("samples", pd.DataFrame)])


def _between_tasks(df: pd.DataFrame) -> pd.DataFrame:
    """The table as the next task would receive it: written to parquet and read back."""
    buf = io.BytesIO()
    df.to_parquet(buf)
    return pd.read_parquet(io.BytesIO(buf.getvalue()))


def evaluates(iteration: int, last: int, eval_every: int) -> bool:
    """Whether the loop evaluates after `iteration` (workflows/rlvr.py `rl_loop` uses the same rule)."""
    return iteration % eval_every == 0 or iteration == last


def generator_policy(spec: RunSpec, origin: PolicyRef, versions: dict, iteration: int, lag: int) -> PolicyRef:
    """The policy iteration `iteration`'s rollout samples with (`pipeline.off_policy_steps` = `lag`):
    version iteration-1-lag -- the one its update starts from when lag is 0 -- but not older than
    the run's `origin`; from `versions` (this loop's policies by version; Flyte promises in
    workflows/rlvr.py) when there, else its published key (a resumed or chunked loop)."""
    from tasks.training import policy_key

    version = max(iteration - 1 - lag, origin.version)
    if version in versions:
        return versions[version]
    if version == origin.version:
        return origin
    return PolicyRef(key=policy_key(spec, version), version=version)


@task(task_config=ray_job("fused"), **task_resources("fused"))
def fused_iterations(spec: RunSpec, origin: PolicyRef, policy: PolicyRef, reference: PolicyRef, dataset: DatasetRef,
                     first: int, count: int, last: int, eval_every: int) -> FusedOut:
    """Iterations first..first+count-1 from `policy` (of the run that began at `origin`); returns the
    last policy, the accuracy of the last evaluation in the chunk (-1.0 when none), and the last
    iteration's scored table."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.common import config_of

    lag = config_of(spec).pipeline.off_policy_steps
    accuracy, samples, versions = -1.0, pd.DataFrame(), {policy.version: policy}

    def sample(it: int):
        generator = generator_policy(spec, origin, versions, it, lag)
        return generator, _between_tasks(rollout.task_function(spec=spec, policy=generator, dataset=dataset, iteration=it))

    # with a lag the next iteration's sampler is already published, so its rollout runs on the
    # generation actors while this iteration scores, runs the reference forward and trains
    ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyroll-rollout") if lag > 0 else None
    pending = None  # the next iteration's rollout (a Future), sampled ahead
    try:
        for it in range(first, first + count):
            generator, batch = pending.result() if pending is not None else sample(it)
            pending = ahead.submit(sample, it + 1) if ahead is not None and it + 1 < first + count else None
            samples = _between_tasks(score.task_function(spec=spec, batch=batch, iteration=it))
            full = _between_tasks(reference_forward.task_function(spec=spec, batch=samples, policy=policy,
                                                                  reference=reference, iteration=it, generator=generator))
            # the training actors live on to the next iteration of this task; the last one's checkpoint
            # holds the trainer state (checkpoint.optimizer_every: tasks/replay.py)
            checkpoint = train.task_function(spec=spec, batch=full, policy=policy, iteration=it,
                                             actor_kept=it < first + count - 1)
            policy = publish_weights.task_function(spec=spec, checkpoint=checkpoint, parent=policy, dataset=dataset,
                                                   iteration=it)
            versions[it] = policy
            if evaluates(it, last, eval_every):
                if pending is not None:
                    pending.result()  # the evaluation loads its policy into the same generation actors
                accuracy = evaluate.task_function(spec=spec, policy=policy, dataset=dataset)
    finally:
        if ahead is not None:
            ahead.shutdown(wait=True, cancel_futures=True)
    return FusedOut(policy=policy, accuracy=accuracy, samples=samples)
