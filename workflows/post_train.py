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

With `--promote` (the launch plan's default) the RL run's final policy is a challenger: `challenge`
moves the champion alias (`run.champion_alias` of the RL config's `run.model_name`) to it iff its final
eval accuracy beats the champion's on the same eval split, the rule of workflows/schedules.py `retrain`.
The champion's score is the one recorded on its model version for that split; when there is none (a
champion promoted on another split, or set by hand) `challenge` measures it there, greedily with the
run's rewards (`champion_accuracy`), and records it; with no champion yet the challenger wins.
"""

from __future__ import annotations

import typing
from pathlib import Path

from flytekit import CronSchedule, LaunchPlan, task, workflow

from configs.checks import check_kind
from configs.schema import load_config
from infra import tracking
from infra.resources import task_resources
from tasks.loop.prompts import read_table
from tasks.run.common import config_of, console, store_of
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from workflows.rlvr import rl_run
from workflows.schedules import decide, recorded_score
from workflows.sft import sft

ROOT = Path(__file__).resolve().parents[1]


@task(**task_resources("controller"))
def started_from(policy: PolicyRef, overrides: typing.List[str]) -> typing.List[str]:
    """`overrides` with `model.path` set to `policy`'s store key (last, so it wins)."""
    return [*overrides, f"model.path={policy.key}"]


def champion_accuracy(spec: RunSpec, key: str, dataset: DatasetRef) -> float:
    """Greedy accuracy of the store version `key` on `dataset`'s eval split, scored with the run's rewards
    (engines/rewards/evaluation.py `evaluate`, the path `flyroll eval` takes), in this process."""
    import tempfile

    from engines.generation.engine import HFGenerationEngine
    from engines.models.modeling import load_policy
    from engines.rewards.evaluation import evaluate

    cfg = config_of(spec)
    table = read_table(spec, dataset.eval_key)
    with tempfile.TemporaryDirectory(prefix="flyroll-champion-") as local:
        store_of(spec).fetch(key, local)   # sha256-checked
        model, tokenizer = load_policy(local)
        metrics, _ = evaluate(HFGenerationEngine(model, tokenizer), tokenizer, table, max_new_tokens=cfg.rollout.max_new_tokens,
                              apply_chat_template=cfg.model.apply_chat_template, reward=cfg.reward, stop=tuple(cfg.rollout.stop))
    return float(metrics["accuracy"])


@task(**task_resources("promotion"))
def challenge(spec: RunSpec, enabled: bool, candidate: PolicyRef, accuracy: float, dataset: DatasetRef) -> bool:
    """Champion/challenger for the RL run of `post_train` (`enabled`: its `promote`): whether `candidate`,
    at eval `accuracy`, was promoted over the champion alias's version (module docstring)."""
    if not enabled:
        return False
    cfg = config_of(spec)
    model, alias = cfg.run.registered_model, cfg.run.champion_alias
    mv = tracking.alias_version(spec.tracking_uri, model, alias)
    if mv is None:
        return decide(spec, candidate, accuracy, PolicyRef(key="", version=0, model_version=""), None,
                      f"no {alias} of {model} yet", dataset, prefix="flyroll.promotion")
    key = mv.tags.get("flyroll.key") or ""
    if not key or mv.source != store_of(spec).uri(key):
        raise ValueError(f"{alias} = {model} version {mv.version} at {mv.source} is not in this run's artifact store "
                         f"{store_of(spec).root}; set run.store_uri to the store it was published to")
    champion = PolicyRef(key=key, version=0, model_version=str(mv.version))
    score, source = recorded_score(spec, champion, dataset), "recorded"
    if score is None:
        console.print(f"[bold]post_train[/] measuring {alias} (model version {mv.version}, {key}) on {dataset.eval_key}")
        score, source = champion_accuracy(spec, key, dataset), "measured by post_train"
        tracking.set_model_version_tags(spec.tracking_uri, model, champion.model_version,
                                        {"flyroll.eval_accuracy": f"{score:.6g}", "flyroll.eval_dataset": dataset.eval_key})
    return decide(spec, candidate, accuracy, champion, score, source, dataset, prefix="flyroll.promotion")


@workflow
def post_train(sft_config: str, rl_config: str = "", sft_set: typing.List[str] = [],  # noqa: B006
               rl_set: typing.List[str] = [], restart: bool = False, promote: bool = False) -> PolicyRef:  # noqa: B006
    """SFT, then RL from its final policy.

    Args:
        sft_config: YAML preset with an `sft` section (e.g. configs/sft_tiny.yaml)
        rl_config: YAML preset of the RL run (default configs/tiny.yaml); its model.path is replaced
        sft_set: overrides of the SFT preset, one JSON list of "dotted.key=value" items
        rl_set: overrides of the RL preset, e.g. '["loop.iterations=4"]'
        restart: start both runs anew instead of resuming them
        promote: move the champion alias to the RL run's final policy iff it beats the champion on the same eval split
    """
    tuned = sft(config=sft_config, restart=restart, set=sft_set)
    return rl_run(rl_config, restart, started_from(policy=tuned, overrides=rl_set), kind="rl",
                  before_finalize=lambda spec, out, dataset: challenge(spec=spec, enabled=promote, candidate=out.policy,
                                                                       accuracy=out.accuracy, dataset=dataset))


def post_train_plan(name: str, sft_config: str, rl_config: str, cron: str, sft_set: typing.Sequence[str] = (),
                    rl_set: typing.Sequence[str] = ()) -> LaunchPlan:
    """A launch plan `name` that runs `post_train` on the cron schedule `cron` (UTC) with the two
    presets (paths relative to the code's root, as `pyflyte run` takes them). Both presets are loaded
    here, and each must belong to its workflow, so a missing file, a bad field or a swapped pair fails
    the package or register command. Each scheduled execution promotes its RL result over the champion
    only if it beats it (`promote` defaults to true here)."""
    check_kind(load_config(ROOT / sft_config, list(sft_set)), "sft")
    check_kind(load_config(ROOT / rl_config, list(rl_set)), "rl")
    return LaunchPlan.get_or_create(workflow=post_train, name=name, schedule=CronSchedule(schedule=cron),
                                    default_inputs={"sft_config": sft_config, "rl_config": rl_config,
                                                    "sft_set": list(sft_set), "rl_set": list(rl_set), "promote": True})
