"""Agentic multi-turn RL as a Flyte workflow (ROLL's second pillar).

    pyflyte run workflows/agentic.py agentic --config configs/frozenlake.yaml
    pyflyte run workflows/agentic.py agentic --config configs/sokoban.yaml
    pyflyte run workflows/agentic.py agentic --config configs/tool_math.yaml

One iteration: episodes in the environment (rollout), environment returns as rewards (scoring),
reference forward, training (loss only on the policy's own tokens), weight sync -- the recipe of
RLVR (tasks/loop/recipe.py `one_iteration`, `run_iterations`) with the same reference/training/weight-sync
tasks and lineage. Evaluation plays fixed held-out seeds
greedily: success rate, effective- and invalid-action rates, turns, return.

With `pipeline.off_policy_steps: k` iteration i's episodes are played by policy version i-1-k (not
before the run's starting policy), as RLVR's asynchronous generation does: on a Flyte cluster
iteration i+1's rollout then runs beside iteration i's update; each row's policy_version names the
version that played it, `rollout/staleness` logs the lag, and the update corrects it with truncated
importance sampling (`algorithm.tis_cap`, required).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import typing

import pandas as pd
from flytekit import dynamic, task, workflow

from infra.resources import task_resources
from tasks.stages.agentic import evaluate_episodes, rollout_episodes, score_episodes
from tasks.run.common import config_of, execution_id, store_of
from tasks.stages.evaluation import finalize
from tasks.stages.prepare import bootstrap_policy, loop_bounds, prepare_run, reference_policy, resume_point
from tasks.run.seeds import EVAL_ENV_SEED0
from tasks.loop.recipe import CHUNK, IterationOut, LoopOut, Stages, one_iteration, run_iterations
from tasks.stages.reference import reference_forward
from tasks.stages.training import train
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.stages.weight_sync import publish_weights


def _episodes(spec: RunSpec, policy: PolicyRef, dataset: DatasetRef, iteration: int):
    """The rollout stage of the recipe: episodes come from the environment's seeds, not from `dataset`."""
    return rollout_episodes(spec=spec, policy=policy, iteration=iteration)


AGENTIC = Stages(rollout=_episodes,                    # B seeds x G episodes
                 score=score_episodes,                 # + reward (returns)
                 reference_forward=reference_forward,  # + reference and old log-probs
                 train=train,                          # loss on policy tokens
                 publish_weights=publish_weights)


@task(**task_resources("dataset"))
def env_dataset(spec: RunSpec) -> DatasetRef:
    """The environment and its fixed held-out seeds as a versioned 'dataset' (lineage of what was evaluated)."""
    cfg = config_of(spec)
    e = cfg.env
    version = hashlib.sha256(json.dumps(e.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]
    key = f"datasets/env-{e.name}-{version}/eval"
    store = store_of(spec)
    if not store.exists(key):
        df = pd.DataFrame({"seed": [EVAL_ENV_SEED0 + i for i in range(e.eval_episodes)], "env": e.name, "kwargs": json.dumps(e.kwargs)})
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "eval.parquet")
            df.to_parquet(path, index=False)
            store.publish_file(path, key, kind="dataset", producer="env_dataset", execution_id=execution_id(),
                               metadata={"rows": len(df), "env": e.name, "domains": {e.name: 1.0}})
    return DatasetRef(train_key=key, eval_key=key)


@workflow
def agentic_iteration(spec: RunSpec, policy: PolicyRef, generator: PolicyRef, reference: PolicyRef, dataset: DatasetRef,
                      iteration: int) -> IterationOut:
    """Update `policy` on episodes played by `generator` (= `policy`, or an older version with
    pipeline.off_policy_steps; a Flyte cluster then plays these episodes beside the previous update)."""
    new_policy, scored = one_iteration(AGENTIC, spec, policy, generator, reference, dataset, iteration)
    return IterationOut(policy=new_policy, samples=scored)


@dynamic(**task_resources("controller"))
def agentic_loop(spec: RunSpec, origin: PolicyRef, start: PolicyRef, reference: PolicyRef, dataset: DatasetRef, last: int,
                 eval_every: int) -> LoopOut:
    """Iterations start.version+1 .. last (CHUNK per node) of the run that began at `origin`; each
    iteration's episodes are played by the policy pipeline.off_policy_steps updates older than the one
    it trains (tasks/loop/recipe.py `generator_policy`; 0 = on-policy)."""
    accuracy = evaluate_episodes(spec=spec, policy=start) if start.version == 0 else -1.0
    end = min(last, start.version + CHUNK)
    policy, accuracy, samples = run_iterations(
        step=lambda policy, generator, it: agentic_iteration(spec=spec, policy=policy, generator=generator,
                                                             reference=reference, dataset=dataset, iteration=it),
        evaluate=lambda policy: evaluate_episodes(spec=spec, policy=policy),
        spec=spec, origin=origin, start=start, first=start.version + 1, end=end, last=last, eval_every=eval_every,
        lag=config_of(spec).pipeline.off_policy_steps, accuracy=accuracy)
    if end < last:
        return agentic_loop(spec=spec, origin=origin, start=policy, reference=reference, dataset=dataset, last=last,
                            eval_every=eval_every)
    return LoopOut(policy=policy, accuracy=accuracy, samples=samples)


@workflow
def agentic(config: str = "configs/frozenlake.yaml", restart: bool = False,
            set: typing.List[str] = []) -> PolicyRef:  # noqa: A002,B006
    """Agentic RL run.

    Args:
        config: a YAML preset with an `env` section
        restart: start a new run instead of resuming
        set: overrides of the preset, one JSON list of "dotted.key=value" items, values read as YAML,
            e.g. '["env.max_turns=6", "rollout.temperature=0.7"]'
    """
    spec, model_spec = prepare_run(config=config, restart=restart, overrides=set)
    dataset = env_dataset(spec=spec)
    base = bootstrap_policy(model_spec=model_spec)
    reference = reference_policy(spec=spec, model_spec=model_spec, base=base)  # model.reference_path, else the base
    start = resume_point(spec=spec, base=base, model_spec=model_spec)
    last, eval_every = loop_bounds(spec=spec)
    out = agentic_loop(spec=spec, origin=base, start=start, reference=reference, dataset=dataset, last=last,
                       eval_every=eval_every)
    return finalize(spec=spec, policy=out.policy, final_accuracy=out.accuracy, samples=out.samples)
