"""One RL iteration and the loop around it, written once for the three loops that run them:
`rl_loop` (workflows/rlvr.py), `agentic_loop` (workflows/agentic.py) and the fused task
(tasks/stages/fused.py).

    rollout -> scoring -> reference forward -> training -> weight sync      (`one_iteration`)
    evaluate after iterations eval_every, 2*eval_every, ... and the last     (`evaluates`)

The stages are passed in (`Stages`), so this module imports none of them: a Flyte workflow passes
its tasks (called at compile time, they return promises; `one_iteration` is then the body of the
`@workflow`), the fused task passes the same tasks' Python functions. `run_iterations` is the loop
of a `@dynamic` node and of the fused task: the policy each rollout samples with
(`generator_policy`, `pipeline.off_policy_steps`), the versions so far, and the evaluation cadence.
"""

from __future__ import annotations

import typing
from typing import Callable

import pandas as pd

from tasks.run.keys import policy_key
from tasks.run.types import DatasetRef, PolicyRef, RunSpec


CHUNK = 25  # iterations per @dynamic node of a workflow's loop; longer runs recurse, keeping each generated workflow small

# What a workflow's iteration and loop return (the Flyte outputs of `rl_iteration` / `agentic_iteration` and
# `rl_loop` / `agentic_loop`): the new policy and its scored table; the loop adds its last evaluation's accuracy.
IterationOut = typing.NamedTuple("IterationOut", [("policy", PolicyRef), ("samples", pd.DataFrame)])
LoopOut = typing.NamedTuple("LoopOut", [("policy", PolicyRef), ("accuracy", float), ("samples", pd.DataFrame)])


class Stages(typing.NamedTuple):
    """The stages of one iteration, each called with keywords as the stage tasks are:

    rollout(spec, policy, dataset, iteration) -> table                      (tasks/stages/rollout.py `rollout`)
    score(spec, batch, iteration) -> table + reward                          (tasks/stages/scoring.py `score`)
    reference_forward(spec, batch, policy, reference, iteration, generator) -> + log-probs (tasks/stages/reference.py)
    train(spec, batch, policy, iteration) -> checkpoint                      (tasks/stages/training.py `train`)
    publish_weights(spec, checkpoint, parent, dataset, iteration) -> policy  (tasks/stages/weight_sync.py)
    """

    rollout: Callable
    score: Callable
    reference_forward: Callable
    train: Callable
    publish_weights: Callable


def one_iteration(stages: Stages, spec: RunSpec, policy: PolicyRef, generator: PolicyRef, reference: PolicyRef,
              dataset: DatasetRef, iteration: int) -> tuple[PolicyRef, pd.DataFrame]:
    """Update `policy` on samples from `generator` (= `policy`, or an older version with
    pipeline.off_policy_steps); returns the new policy and the scored table."""
    batch = stages.rollout(spec=spec, policy=generator, dataset=dataset, iteration=iteration)          # B x G samples
    scored = stages.score(spec=spec, batch=batch, iteration=iteration)                                  # + reward
    full = stages.reference_forward(spec=spec, batch=scored, policy=policy, reference=reference,         # + log-probs
                                    iteration=iteration, generator=generator)
    checkpoint = stages.train(spec=spec, batch=full, policy=policy, iteration=iteration)               # actor update
    new_policy = stages.publish_weights(spec=spec, checkpoint=checkpoint, parent=policy, dataset=dataset,
                                        iteration=iteration)                                            # weight sync
    return new_policy, scored


def evaluates(iteration: int, last: int, eval_every: int) -> bool:
    """Whether the loop evaluates after `iteration`: every `eval_every` iterations and at the last."""
    return iteration % eval_every == 0 or iteration == last


def generator_policy(spec: RunSpec, origin: PolicyRef, versions: dict, iteration: int, lag: int) -> PolicyRef:
    """The policy iteration `iteration`'s rollout samples with (`pipeline.off_policy_steps` = `lag`):
    version iteration-1-lag -- the one its update starts from when lag is 0 -- but not older than
    the run's `origin`; from `versions` (this loop's policies by version; Flyte promises in
    workflows/rlvr.py) when there, else its published key (a resumed or chunked loop)."""
    version = max(iteration - 1 - lag, origin.version)
    if version in versions:
        return versions[version]
    if version == origin.version:
        return origin
    return PolicyRef(key=policy_key(spec, version), version=version)


LoopState = typing.NamedTuple("LoopState", [("policy", PolicyRef), ("accuracy", float), ("samples", pd.DataFrame)])


def run_iterations(step: Callable, evaluate: Callable, spec: RunSpec, origin: PolicyRef, start: PolicyRef, first: int,
                   end: int, last: int, eval_every: int, lag: int, accuracy: float = -1.0,
                   versions: dict | None = None) -> LoopState:
    """Iterations first..end from `start` (of the run that began at `origin`; `last` is the run's
    last iteration), evaluating as `evaluates` says. `step(policy, generator, iteration)` runs one
    iteration (`one_iteration` over the caller's stages, or a Flyte sub-workflow) and returns (new
    policy, scored table); `evaluate(policy)` the accuracy. `versions` (filled here): the loop's
    policies by version, shared with a caller that samples ahead (tasks/stages/fused.py). Returns the last
    policy, the accuracy of the last evaluation (`accuracy` when none ran) and the last scored table."""
    policy, samples = start, pd.DataFrame()
    versions = {} if versions is None else versions
    versions[start.version] = start
    for it in range(first, end + 1):
        generator = generator_policy(spec, origin, versions, it, lag)
        policy, samples = step(policy, generator, it)
        versions[it] = policy
        if evaluates(it, last, eval_every):
            accuracy = evaluate(policy)
    return LoopState(policy, accuracy, samples)
