"""RL with verifiable rewards as a Flyte workflow.

    pyflyte run workflows/rlvr.py rlvr                                  # tiny default, ~10 min on 2 CPU cores
    pyflyte run workflows/rlvr.py rlvr --config configs/tiny.yaml       # same, explicit
    pyflyte run workflows/rlvr.py rlvr --config configs/tiny.yaml --restart   # start a new run instead of resuming

One iteration (`rl_iteration`) is five tasks -- rollout, scoring, reference forward, training,
weight sync -- each with its own resources and Ray cluster. `rl_loop` (a bounded @dynamic) chains
iterations from a start version, evaluating at the start, every `loop.eval_every` iterations and at
the end; runs longer than CHUNK iterations continue in a nested `rl_loop`. With `loop.fuse: N` it
runs N iterations at a time in one task on one Ray cluster instead (tasks/fused.py). A rerun of the same
config resumes from the last published policy version of that run.
"""

from __future__ import annotations

import typing
import warnings

import pandas as pd
from flytekit import dynamic, workflow

from infra.resources import task_resources
from tasks.common import config_of, logged
from tasks.evaluation import evaluate, finalize
from tasks.fused import evaluates, fused_iterations, generator_policy
from tasks.prepare import bootstrap_policy, loop_bounds, make_dataset, prepare_run, reference_policy, resume_point
from tasks.reference import reference_forward
from tasks.rollout import rollout
from tasks.scoring import score
from tasks.training import train
from tasks.types import DatasetRef, PolicyRef, RunSpec
from tasks.weight_sync import publish_weights

# flytekit registers a bool input as both `--restart` and `--restart/--no_restart`; click then warns
warnings.filterwarnings("ignore", message="The parameter --restart is used more than once")

CHUNK = 25  # iterations per @dynamic node; longer runs recurse, keeping each generated workflow small

IterationOut = typing.NamedTuple("IterationOut", [("policy", PolicyRef), ("samples", pd.DataFrame)])
LoopOut = typing.NamedTuple("LoopOut", [("policy", PolicyRef), ("accuracy", float), ("samples", pd.DataFrame)])


@workflow
def rl_iteration(spec: RunSpec, policy: PolicyRef, generator: PolicyRef, reference: PolicyRef, dataset: DatasetRef,
                 iteration: int) -> IterationOut:
    """Update `policy` on samples from `generator` (= `policy`, or an older version with
    pipeline.off_policy_steps; a Flyte cluster then runs this rollout beside the previous update)."""
    batch = rollout(spec=spec, policy=generator, dataset=dataset, iteration=iteration)         # B x G samples
    scored = score(spec=spec, batch=batch, iteration=iteration)                                 # + reward (DAPO: in rollout)
    full = reference_forward(spec=spec, batch=scored, policy=policy, reference=reference, iteration=iteration, generator=generator)
    checkpoint = train(spec=spec, batch=full, policy=policy, iteration=iteration)              # actor update
    new_policy = publish_weights(spec=spec, checkpoint=checkpoint, parent=policy, dataset=dataset, iteration=iteration)
    return IterationOut(policy=new_policy, samples=scored)


@dynamic(**task_resources("weight_sync"))
def rl_loop(spec: RunSpec, origin: PolicyRef, start: PolicyRef, reference: PolicyRef, dataset: DatasetRef, last: int,
            eval_every: int) -> LoopOut:
    """Iterations start.version+1 .. last (CHUNK per node) of the run that began at `origin`."""
    cfg = config_of(spec)
    policy, samples = start, pd.DataFrame()
    # at the run's start, and on a resume whose start version's evaluation never ran (killed in between)
    owed = start.version > 0 and evaluates(start.version, last, eval_every) and not logged(spec, "eval/accuracy", start.version)
    accuracy = evaluate(spec=spec, policy=start, dataset=dataset) if start.version == 0 or owed else -1.0
    end = min(last, start.version + CHUNK)
    versions = {start.version: start}  # the policies this node has, for generators that lag (off_policy_steps)
    it = start.version + 1
    while it <= end:
        if cfg.loop.fuse > 1:  # up to `fuse` iterations, with their evaluations, in one task on one Ray cluster
            n = min(cfg.loop.fuse, end - it + 1)
            policy, chunk_accuracy, samples = fused_iterations(spec=spec, origin=origin, policy=policy, reference=reference,
                                                               dataset=dataset, first=it, count=n, last=last,
                                                               eval_every=eval_every)
            if any(evaluates(i, last, eval_every) for i in range(it, it + n)):
                accuracy = chunk_accuracy
            it += n
            versions[it - 1] = policy
            continue
        generator = generator_policy(spec, origin, versions, it, cfg.pipeline.off_policy_steps)
        policy, samples = rl_iteration(spec=spec, policy=policy, generator=generator, reference=reference,
                                       dataset=dataset, iteration=it)
        versions[it] = policy
        if evaluates(it, last, eval_every):
            accuracy = evaluate(spec=spec, policy=policy, dataset=dataset)
        it += 1
    if end < last:
        return rl_loop(spec=spec, origin=origin, start=policy, reference=reference, dataset=dataset, last=last,
                       eval_every=eval_every)
    return LoopOut(policy=policy, accuracy=accuracy, samples=samples)


@workflow
def rlvr(config: str = "", restart: bool = False) -> PolicyRef:
    """RLVR run. config: path to a YAML preset (default: configs/tiny.yaml). restart: start a new run
    instead of resuming the last one with the same name and config."""
    spec, model_spec = prepare_run(config=config, restart=restart)
    dataset = make_dataset(spec=spec)
    base = bootstrap_policy(model_spec=model_spec)
    reference = reference_policy(spec=spec, model_spec=model_spec, base=base)  # model.reference_path, else the base
    start = resume_point(spec=spec, base=base, model_spec=model_spec)
    last, eval_every = loop_bounds(spec=spec)
    out = rl_loop(spec=spec, origin=base, start=start, reference=reference, dataset=dataset, last=last, eval_every=eval_every)
    return finalize(spec=spec, policy=out.policy, final_accuracy=out.accuracy, samples=out.samples)

