"""Preference tuning (the DPO family) as a Flyte workflow, in the RL runs' lineage (docs/post-training.md).

    pyflyte run workflows/dpo.py dpo --config configs/dpo_tiny.yaml                        # pairs from a file
    pyflyte run workflows/dpo.py dpo --config configs/dpo_tiny.yaml --set '["dpo.loss=ipo", "dpo.beta=0.5"]'
    pyflyte run workflows/dpo.py dpo --config configs/dpo_on_policy_tiny.yaml              # pairs the policy samples

workflows/sft.py's shape: `prepare_run` (kind "dpo"), the starting policy, the reference
(`model.reference_path`, else the starting policy; vocabulary-checked), then `dpo_versions`:

- dpo.pairs=file: the pairs as a versioned dataset, then per version `dpo.steps_per_version` optimizer
  steps in the training actors with the loss `dpo.loss`, the reference's log-probs from the reference
  actor, held-out eval/dpo_loss and eval/rewards/*, and the publish (`post_loop`);
- dpo.pairs=on_policy: the `data` section's prompt tables (RL's `make_dataset`), then per round the
  RL rollout and scoring stages on the current policy, DPO on each group's best vs worst response,
  and the publish (`on_policy_rounds`).

A rerun of the same config resumes from its last published version.
"""

from __future__ import annotations

import typing

import pandas as pd
from flytekit import dynamic, workflow

from infra.resources import task_resources
from tasks.loop.recipe import LoopOut
from tasks.run.common import config_of
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.stages.evaluation import evaluate, finalize
from tasks.stages.post_training import make_post_dataset, post_bounds, post_train
from tasks.stages.prepare import bootstrap_policy, make_dataset, prepare_run, reference_policy, resume_point
from tasks.stages.rollout import rollout
from tasks.stages.scoring import score
from tasks.stages.weight_sync import publish_weights
from workflows.sft import post_loop


@dynamic(**task_resources("controller"))
def on_policy_rounds(spec: RunSpec, start: PolicyRef, reference: PolicyRef, dataset: DatasetRef) -> LoopOut:
    """Rounds start.version+1 .. dpo.rounds: sample (the rollout stage), score (the scoring stage),
    DPO on best vs worst (`post_train` with the scored samples), publish; eval/accuracy at the start,
    every dpo.eval_every rounds and the last."""
    sec = config_of(spec).dpo
    policy, accuracy, scored = start, -1.0, None
    if start.version == 0:
        accuracy = evaluate(spec=spec, policy=start, dataset=dataset)
    for version in range(start.version + 1, sec.rounds + 1):
        batch = rollout(spec=spec, policy=policy, dataset=dataset, iteration=version)
        scored = score(spec=spec, batch=batch, iteration=version)
        checkpoint = post_train(spec=spec, policy=policy, reference=reference, dataset=dataset, version=version,
                                samples=scored)
        policy = publish_weights(spec=spec, checkpoint=checkpoint, parent=policy, dataset=dataset, iteration=version,
                                 kind="dpo")
        if version == sec.rounds or (sec.eval_every and version % sec.eval_every == 0):
            accuracy = evaluate(spec=spec, policy=policy, dataset=dataset)
    return LoopOut(policy=policy, accuracy=accuracy, samples=pd.DataFrame() if scored is None else scored)


@dynamic(**task_resources("controller"))
def dpo_versions(spec: RunSpec, base: PolicyRef, start: PolicyRef, reference: PolicyRef) -> LoopOut:
    """The run's versions from `start`, from a pairs file or from on-policy rounds (dpo.pairs)."""
    if config_of(spec).dpo.pairs == "on_policy":
        return on_policy_rounds(spec=spec, start=start, reference=reference, dataset=make_dataset(spec=spec, base=base))
    dataset = make_post_dataset(spec=spec, base=base)
    bounds = post_bounds(spec=spec, dataset=dataset)
    return post_loop(spec=spec, kind="dpo", start=start, reference=reference, dataset=dataset, last=bounds.last,
                     eval_every=bounds.eval_every, rewards=bounds.rewards)


@workflow
def dpo(config: str = "", restart: bool = False, set: typing.List[str] = []) -> PolicyRef:  # noqa: A002,B006
    """Preference-tuning run.

    Args:
        config: path to a YAML preset with a `dpo` section (e.g. configs/dpo_tiny.yaml)
        restart: start a new run instead of resuming the last one with the same name and config
        set: overrides of the preset, one JSON list of "dotted.key=value" items, values read as YAML,
            e.g. '["dpo.loss=ipo", "dpo.beta=0.5"]'
    """
    spec, model_spec = prepare_run(config=config, restart=restart, overrides=set, kind="dpo")
    base = bootstrap_policy(model_spec=model_spec)
    reference = reference_policy(spec=spec, model_spec=model_spec, base=base)
    start = resume_point(spec=spec, base=base, model_spec=model_spec)
    out = dpo_versions(spec=spec, base=base, start=start, reference=reference)
    return finalize(spec=spec, policy=out.policy, final_accuracy=out.accuracy, samples=out.samples)
