"""Agentic multi-turn RL as a Flyte workflow (ROLL's second pillar).

    pyflyte run workflows/agentic.py agentic --config configs/frozenlake.yaml
    pyflyte run workflows/agentic.py agentic --config configs/sokoban.yaml
    pyflyte run workflows/agentic.py agentic --config configs/tool_math.yaml

One iteration: episodes in the environment (rollout), environment returns as rewards (scoring),
reference forward, training (loss only on the policy's own tokens), weight sync -- the same
reference/training/weight-sync tasks and lineage as RLVR. Evaluation plays fixed held-out seeds
greedily: success rate, effective- and invalid-action rates, turns, return.
"""

from __future__ import annotations

import typing
import warnings

import pandas as pd
from flytekit import dynamic, task, workflow

from infra.resources import task_resources
from tasks.agentic import evaluate_episodes, rollout_episodes, score_episodes
from tasks.common import config_of, execution_id, store_of
from tasks.evaluation import finalize
from tasks.prepare import EVAL_SEED0, bootstrap_policy, loop_bounds, prepare_run, reference_policy, resume_point
from tasks.reference import reference_forward
from tasks.training import train
from tasks.types import DatasetRef, PolicyRef, RunSpec
from tasks.weight_sync import publish_weights

warnings.filterwarnings("ignore", message="The parameter --restart is used more than once")

CHUNK = 25

IterationOut = typing.NamedTuple("IterationOut", [("policy", PolicyRef), ("samples", pd.DataFrame)])
LoopOut = typing.NamedTuple("LoopOut", [("policy", PolicyRef), ("accuracy", float), ("samples", pd.DataFrame)])


@task(**task_resources("weight_sync"))
def env_dataset(spec: RunSpec) -> DatasetRef:
    """The environment and its fixed held-out seeds as a versioned 'dataset' (lineage of what was evaluated)."""
    import hashlib
    import json
    import os
    import tempfile

    cfg = config_of(spec)
    e = cfg.env
    version = hashlib.sha256(json.dumps(e.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]
    key = f"datasets/env-{e.name}-{version}/eval"
    store = store_of(spec)
    if not store.exists(key):
        df = pd.DataFrame({"seed": [EVAL_SEED0 + i for i in range(e.eval_episodes)], "env": e.name, "kwargs": json.dumps(e.kwargs)})
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "eval.parquet")
            df.to_parquet(path, index=False)
            store.publish_file(path, key, kind="dataset", producer="env_dataset", execution_id=execution_id(),
                               metadata={"rows": len(df), "env": e.name, "domains": {e.name: 1.0}})
    return DatasetRef(train_key=key, eval_key=key)


@workflow
def agentic_iteration(spec: RunSpec, policy: PolicyRef, reference: PolicyRef, dataset: DatasetRef, iteration: int) -> IterationOut:
    batch = rollout_episodes(spec=spec, policy=policy, iteration=iteration)                    # B seeds x G episodes
    scored = score_episodes(spec=spec, batch=batch, iteration=iteration)                        # + reward (returns)
    full = reference_forward(spec=spec, batch=scored, policy=policy, reference=reference, iteration=iteration)
    checkpoint = train(spec=spec, batch=full, policy=policy, iteration=iteration)               # loss on policy tokens
    new_policy = publish_weights(spec=spec, checkpoint=checkpoint, parent=policy, dataset=dataset, iteration=iteration)
    return IterationOut(policy=new_policy, samples=scored)


@dynamic(**task_resources("weight_sync"))
def agentic_loop(spec: RunSpec, start: PolicyRef, reference: PolicyRef, dataset: DatasetRef, last: int, eval_every: int) -> LoopOut:
    policy, samples = start, pd.DataFrame()
    accuracy = evaluate_episodes(spec=spec, policy=start) if start.version == 0 else -1.0
    end = min(last, start.version + CHUNK)
    for it in range(start.version + 1, end + 1):
        policy, samples = agentic_iteration(spec=spec, policy=policy, reference=reference, dataset=dataset, iteration=it)
        if it % eval_every == 0 or it == last:
            accuracy = evaluate_episodes(spec=spec, policy=policy)
    if end < last:
        return agentic_loop(spec=spec, start=policy, reference=reference, dataset=dataset, last=last, eval_every=eval_every)
    return LoopOut(policy=policy, accuracy=accuracy, samples=samples)


@workflow
def agentic(config: str = "configs/frozenlake.yaml", restart: bool = False) -> PolicyRef:
    """Agentic RL run. config: a preset with an `env` section. restart: start a new run instead of resuming."""
    spec, model_spec = prepare_run(config=config, restart=restart)
    dataset = env_dataset(spec=spec)
    base = bootstrap_policy(model_spec=model_spec)
    reference = reference_policy(spec=spec, model_spec=model_spec, base=base)  # model.reference_path, else the base
    start = resume_point(spec=spec, base=base, model_spec=model_spec)
    last, eval_every = loop_bounds(spec=spec)
    out = agentic_loop(spec=spec, start=start, reference=reference, dataset=dataset, last=last, eval_every=eval_every)
    return finalize(spec=spec, policy=out.policy, final_accuracy=out.accuracy, samples=out.samples)
