"""RL with verifiable rewards as a Flyte workflow.

    pyflyte run workflows/rlvr.py rlvr                                  # tiny default, ~10 min on 2 CPU cores
    pyflyte run workflows/rlvr.py rlvr --config configs/tiny.yaml       # same, explicit
    pyflyte run workflows/rlvr.py rlvr --config configs/tiny.yaml --restart   # start a new run instead of resuming
    pyflyte run workflows/rlvr.py rlvr --set '["rollout.temperature=0.7", "training.lr=1e-5"]'   # overrides (one JSON list)

One iteration (`rl_iteration`) is five tasks -- rollout, scoring, reference forward, training,
weight sync -- each with its own resources and Ray cluster, in the order tasks/loop/recipe.py
`one_iteration` writes once for every loop (this one, workflows/agentic.py and the fused task). `rl_loop` (a bounded @dynamic) chains
iterations from a start version, evaluating at the start, every `loop.eval_every` iterations and at
the end; runs longer than CHUNK iterations continue in a nested `rl_loop`. With `loop.fuse: N` it
runs N iterations at a time in one task on one Ray cluster instead (tasks/stages/fused.py). A rerun of the same
config resumes from the last published policy version of that run.
"""

from __future__ import annotations

import typing

import pandas as pd
from flytekit import dynamic, workflow

from infra.resources import task_resources
from tasks.run.common import config_of, logged
from tasks.stages.evaluation import evaluate, finalize
from tasks.stages.fused import fused_iterations
from tasks.stages.prepare import bootstrap_policy, loop_bounds, make_dataset, prepare_run, reference_policy, resume_point
from tasks.loop.recipe import CHUNK, IterationOut, LoopOut, Stages, evaluates, one_iteration, run_iterations
from tasks.stages.reference import reference_forward
from tasks.stages.rollout import rollout
from tasks.stages.scoring import score
from tasks.stages.training import train
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.stages.weight_sync import publish_weights

RLVR = Stages(rollout=rollout,                      # B prompts x G samples
              score=score,                          # + reward (DAPO: already in rollout)
              reference_forward=reference_forward,  # + reference and old log-probs (and values)
              train=train,                          # actor (and critic) update -> checkpoint
              publish_weights=publish_weights)      # new policy version; generators take it


@workflow
def rl_iteration(spec: RunSpec, policy: PolicyRef, generator: PolicyRef, reference: PolicyRef, dataset: DatasetRef,
                 iteration: int) -> IterationOut:
    """Update `policy` on samples from `generator` (= `policy`, or an older version with
    pipeline.off_policy_steps; a Flyte cluster then runs this rollout beside the previous update)."""
    new_policy, scored = one_iteration(RLVR, spec, policy, generator, reference, dataset, iteration)
    return IterationOut(policy=new_policy, samples=scored)


@dynamic(**task_resources("controller"))
def rl_loop(spec: RunSpec, origin: PolicyRef, start: PolicyRef, reference: PolicyRef, dataset: DatasetRef, last: int,
            eval_every: int) -> LoopOut:
    """Iterations start.version+1 .. last (CHUNK per node) of the run that began at `origin`."""
    cfg = config_of(spec)
    # at the run's start, and on a resume whose start version's evaluation never ran (killed in between)
    owed = start.version > 0 and evaluates(start.version, last, eval_every) and not logged(spec, "eval/accuracy", start.version)
    accuracy = evaluate(spec=spec, policy=start, dataset=dataset) if start.version == 0 or owed else -1.0
    end = min(last, start.version + CHUNK)
    if cfg.loop.fuse > 1:  # up to `fuse` iterations, with their evaluations, in one task on one Ray cluster
        policy, samples = start, pd.DataFrame()
        for it in range(start.version + 1, end + 1, cfg.loop.fuse):
            n = min(cfg.loop.fuse, end - it + 1)
            policy, chunk_accuracy, samples = fused_iterations(spec=spec, origin=origin, policy=policy, reference=reference,
                                                               dataset=dataset, first=it, count=n, last=last,
                                                               eval_every=eval_every)
            if any(evaluates(i, last, eval_every) for i in range(it, it + n)):
                accuracy = chunk_accuracy
    else:
        policy, accuracy, samples = run_iterations(
            step=lambda policy, generator, it: rl_iteration(spec=spec, policy=policy, generator=generator,
                                                            reference=reference, dataset=dataset, iteration=it),
            evaluate=lambda policy: evaluate(spec=spec, policy=policy, dataset=dataset),
            spec=spec, origin=origin, start=start, first=start.version + 1, end=end, last=last, eval_every=eval_every,
            lag=cfg.pipeline.off_policy_steps, accuracy=accuracy)
    if end < last:
        return rl_loop(spec=spec, origin=origin, start=policy, reference=reference, dataset=dataset, last=last,
                       eval_every=eval_every)
    return LoopOut(policy=policy, accuracy=accuracy, samples=samples)


@workflow
def rlvr(config: str = "", restart: bool = False, set: typing.List[str] = []) -> PolicyRef:  # noqa: A002,B006
    """RLVR run.

    Args:
        config: path to a YAML preset (default: configs/tiny.yaml)
        restart: start a new run instead of resuming the last one with the same name and config
        set: overrides of the preset, one JSON list of "dotted.key=value" items, values read as YAML,
            e.g. '["rollout.temperature=0.7", "training.lr=1e-5"]'
    """
    return rl_run(config, restart, set, kind="rl")


def rl_run(config: str, restart: bool, overrides, kind: str, before_finalize=None) -> PolicyRef:
    """The body of `rlvr` (and of workflows/distill.py `distill_on_policy`, `kind` "on_policy_distill",
    and of workflows/post_train.py), called while a workflow is compiled; `overrides`: a list or a task's
    output. `before_finalize(spec, out, dataset)`: a node to run after the loop and before the report
    (post_train's champion/challenger decision)."""
    spec, model_spec = prepare_run(config=config, restart=restart, overrides=overrides, kind=kind)
    base = bootstrap_policy(model_spec=model_spec)
    dataset = make_dataset(spec=spec, base=base)  # prompts bounded by the policy's tokenizer and context
    reference = reference_policy(spec=spec, model_spec=model_spec, base=base)  # model.reference_path, else the base
    start = resume_point(spec=spec, base=base, model_spec=model_spec)
    last, eval_every = loop_bounds(spec=spec)
    out = rl_loop(spec=spec, origin=base, start=start, reference=reference, dataset=dataset, last=last, eval_every=eval_every)
    final = finalize(spec=spec, policy=out.policy, final_accuracy=out.accuracy, samples=out.samples)
    if before_finalize is not None:
        before_finalize(spec, out, dataset) >> final
    return final

