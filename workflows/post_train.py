"""SFT then RL as one Flyte execution: the RL run starts from the SFT run's final policy version.

    pyflyte run workflows/post_train.py post_train --sft_config configs/sft_tiny.yaml --rl_config configs/tiny.yaml
    pyflyte run workflows/post_train.py post_train --sft_config configs/sft_tiny.yaml --rl_set '["loop.iterations=4"]'

The two runs are the ordinary `sft` (workflows/sft.py) and `rlvr` (workflows/rlvr.py) workflows as
sub-workflows, each with its own MLflow run, config hash and dataset; `rl_config` gets
`model.path=<the SFT run's final policy key>` appended to its overrides, so its versions' manifests
lead back through the SFT versions to the base model (`flyroll lineage`). Both configs must name the
same artifact store (run.store_uri / run.output_dir), since the RL run reads the SFT policy from it.
`post_train_plan` schedules it as a launch plan. A DPO or further SFT run chains the same way, by
`model.path`.
"""

from __future__ import annotations

import typing
from pathlib import Path

from flytekit import CronSchedule, LaunchPlan, task, workflow

from configs.checks import check_kind
from configs.schema import load_config
from infra.resources import task_resources
from tasks.run.types import PolicyRef
from workflows.rlvr import rlvr
from workflows.sft import sft

ROOT = Path(__file__).resolve().parents[1]


@task(**task_resources("controller"))
def started_from(policy: PolicyRef, overrides: typing.List[str]) -> typing.List[str]:
    """`overrides` with `model.path` set to `policy`'s store key (last, so it wins)."""
    return [*overrides, f"model.path={policy.key}"]


@workflow
def post_train(sft_config: str, rl_config: str = "", sft_set: typing.List[str] = [],  # noqa: B006
               rl_set: typing.List[str] = [], restart: bool = False) -> PolicyRef:  # noqa: B006
    """SFT, then RL from its final policy.

    Args:
        sft_config: YAML preset with an `sft` section (e.g. configs/sft_tiny.yaml)
        rl_config: YAML preset of the RL run (default configs/tiny.yaml); its model.path is replaced
        sft_set: overrides of the SFT preset, one JSON list of "dotted.key=value" items
        rl_set: overrides of the RL preset, e.g. '["loop.iterations=4"]'
        restart: start both runs anew instead of resuming them
    """
    tuned = sft(config=sft_config, restart=restart, set=sft_set)
    return rlvr(config=rl_config, restart=restart, set=started_from(policy=tuned, overrides=rl_set))


def post_train_plan(name: str, sft_config: str, rl_config: str, cron: str, sft_set: typing.Sequence[str] = (),
                    rl_set: typing.Sequence[str] = ()) -> LaunchPlan:
    """A launch plan `name` that runs `post_train` on the cron schedule `cron` (UTC) with the two
    presets (paths relative to the code's root, as `pyflyte run` takes them). Both presets are loaded
    here, and each must belong to its workflow, so a missing file, a bad field or a swapped pair fails
    the package or register command."""
    check_kind(load_config(ROOT / sft_config, list(sft_set)), "sft")
    check_kind(load_config(ROOT / rl_config, list(rl_set)), "rl")
    return LaunchPlan.get_or_create(workflow=post_train, name=name, schedule=CronSchedule(schedule=cron),
                                    default_inputs={"sft_config": sft_config, "rl_config": rl_config,
                                                    "sft_set": list(sft_set), "rl_set": list(rl_set)})
