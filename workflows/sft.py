"""Supervised fine-tuning as a Flyte workflow, in the RL runs' lineage (docs/post-training.md).

    pyflyte run workflows/sft.py sft --config configs/sft_tiny.yaml                 # the tiny policy on demonstrations
    pyflyte run workflows/sft.py sft --config configs/sft_tiny.yaml --set '["sft.epochs=2"]'

The run is the RL run's shape with the RL stages replaced: the config is checked and the MLflow run
opened (`prepare_run`, kind "sft"), the starting policy built or imported (`model.path`: a model
folder, a package, or any run's published version, so SFT can follow RL or DPO), the demonstrations
read into a versioned dataset, then each version's `sft.steps_per_version` optimizer steps run in
the training actors (`post_train`, any `training.strategy`, LoRA) and are published as the run's next
policy version (`publish_weights`: manifest, MLflow model version, lineage to the parent version and
the dataset), with the held-out loss; where eval rows carry answers, the run's rewards score greedy
answers at the start, every `sft.eval_every` versions and at the end. A rerun of the same config
resumes from its last published version.
"""

from __future__ import annotations

import typing

import pandas as pd
from flytekit import dynamic, workflow

from infra.resources import task_resources
from tasks.loop.recipe import LoopOut
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.stages.evaluation import evaluate, finalize
from tasks.stages.post_training import make_post_dataset, post_bounds, post_train
from tasks.stages.prepare import bootstrap_policy, prepare_run, resume_point
from tasks.stages.weight_sync import publish_weights


@dynamic(**task_resources("controller"))
def post_loop(spec: RunSpec, kind: str, start: PolicyRef, reference: PolicyRef, dataset: DatasetRef, last: int,
              eval_every: int, rewards: bool) -> LoopOut:
    """Versions start.version+1 .. last of an SFT or DPO run (`kind`): train, publish, and with
    `rewards` (eval rows with answers) evaluate at the start, every `eval_every` versions and the last."""
    policy, accuracy = start, -1.0
    if rewards and start.version == 0:
        accuracy = evaluate(spec=spec, policy=start, dataset=dataset)
    for version in range(start.version + 1, last + 1):
        checkpoint = post_train(spec=spec, policy=policy, reference=reference, dataset=dataset, version=version)
        policy = publish_weights(spec=spec, checkpoint=checkpoint, parent=policy, dataset=dataset, iteration=version,
                                 kind=kind)
        if rewards and (version == last or (eval_every and version % eval_every == 0)):
            accuracy = evaluate(spec=spec, policy=policy, dataset=dataset)
    return LoopOut(policy=policy, accuracy=accuracy, samples=pd.DataFrame())


@workflow
def sft(config: str = "", restart: bool = False, set: typing.List[str] = []) -> PolicyRef:  # noqa: A002,B006
    """Supervised fine-tuning run.

    Args:
        config: path to a YAML preset with an `sft` section (e.g. configs/sft_tiny.yaml)
        restart: start a new run instead of resuming the last one with the same name and config
        set: overrides of the preset, one JSON list of "dotted.key=value" items, values read as YAML,
            e.g. '["sft.epochs=2", "training.lr=1e-5"]'
    """
    spec, model_spec = prepare_run(config=config, restart=restart, overrides=set, kind="sft")
    base = bootstrap_policy(model_spec=model_spec)
    dataset = make_post_dataset(spec=spec, base=base)
    start = resume_point(spec=spec, base=base, model_spec=model_spec)
    bounds = post_bounds(spec=spec, dataset=dataset)
    out = post_loop(spec=spec, kind="sft", start=start, reference=base, dataset=dataset, last=bounds.last,
                    eval_every=bounds.eval_every, rewards=bounds.rewards)
    return finalize(spec=spec, policy=out.policy, final_accuracy=out.accuracy, samples=out.samples)
