"""Distillation as Flyte workflows, in the RL runs' lineage (docs/post-training.md): offline logit
distillation (`distill`) and on-policy distillation (`distill_on_policy`, at the end of this file).

    pyflyte run workflows/distill.py distill --config configs/distill_tiny.yaml --set '["distill.teacher=runs/<run id>/policy/v0020"]'
    pyflyte run workflows/distill.py distill_on_policy --config configs/distill_on_policy_tiny.yaml

The student is `model.path` (or the bootstrapped tiny model), the teacher `distill.teacher` (any model
flyroll can import, or any run's published version); a teacher whose tokenizer differs from the
student's is refused before any cluster starts, naming both (`teacher_policy`). The teacher's top-k
next-token log-probs on the demonstrations are computed once on the reference actor and stored beside
the dataset (`teacher_topk`; a second student of the same teacher and data reuses them); then, per
version, `distill.steps_per_version` optimizer steps of `distill.divergence` on that top-k mixed with
the SFT loss (`distill.divergence_weight`), published as the run's next policy version with the
held-out eval/loss and eval/divergence (`post_train`, `publish_weights`).
"""

from __future__ import annotations

import typing

from flytekit import workflow

from tasks.run.types import PolicyRef
from tasks.stages.evaluation import finalize
from tasks.stages.post_training import make_post_dataset, post_bounds, teacher_policy, teacher_topk
from tasks.stages.prepare import bootstrap_policy, prepare_run, resume_point
from workflows.rlvr import rl_run
from workflows.sft import post_loop


@workflow
def distill(config: str = "", restart: bool = False, set: typing.List[str] = []) -> PolicyRef:  # noqa: A002,B006
    """Distillation run.

    Args:
        config: path to a YAML preset with a `distill` section (e.g. configs/distill_tiny.yaml)
        restart: start a new run instead of resuming the last one with the same name and config
        set: overrides of the preset, one JSON list of "dotted.key=value" items, values read as YAML,
            e.g. '["distill.divergence=reverse_kl"]'
    """
    spec, model_spec = prepare_run(config=config, restart=restart, overrides=set, kind="distill")
    base = bootstrap_policy(model_spec=model_spec)
    teacher = teacher_policy(spec=spec, base=base)          # refused here when its tokenizer is not the student's
    dataset = make_post_dataset(spec=spec, base=base)
    teacher = teacher_topk(spec=spec, teacher=teacher, dataset=dataset)
    start = resume_point(spec=spec, base=base, model_spec=model_spec)
    bounds = post_bounds(spec=spec, dataset=dataset)
    out = post_loop(spec=spec, kind="distill", start=start, reference=teacher, dataset=dataset, last=bounds.last,
                    eval_every=bounds.eval_every, rewards=bounds.rewards)
    return finalize(spec=spec, policy=out.policy, final_accuracy=out.accuracy, samples=out.samples)


@workflow
def distill_on_policy(config: str = "", restart: bool = False, set: typing.List[str] = []) -> PolicyRef:  # noqa: A002,B006
    """On-policy distillation run: the RL loop of workflows/rlvr.py (rollout, scoring, reference forward,
    training, weight sync) with the teacher as the reference model and `algorithm.advantage:
    on_policy_distill`, so every token the student samples is trained on minus its reverse KL to the
    teacher (engines/algorithms/advantages.py). The same config runs identically under `rlvr`; this entry
    refuses a config without that advantage, and both tag and publish the run as "on_policy_distill".

    Args:
        config: path to a YAML preset with algorithm.advantage on_policy_distill and model.reference_path
            the teacher (e.g. configs/distill_on_policy_tiny.yaml)
        restart: start a new run instead of resuming the last one with the same name and config
        set: overrides of the preset, one JSON list of "dotted.key=value" items, values read as YAML
    """
    return rl_run(config, restart, set, kind="on_policy_distill")
