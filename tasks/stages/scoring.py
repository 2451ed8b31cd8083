"""Scoring: verifiable rewards per domain in reward-worker actors; a broken reward costs one sample.

Every row goes to the reward workers (tasks/actors/pools.py `score_table`): a reward that raises, times
out or returns no finite number costs that sample (scored 0, flagged in `reward_error`), a worker that
crashes has its rows re-scored one by one. A domain whose reward fails on more than
reward.max_error_rate of the rows fails the run, once the batch's reward/* metrics are logged. Domains routed to a model reward (`judge`, `reward_model`) are scored in
batches by a model each reward worker loads once (engines/rewards/models.py).

With dynamic sampling (`algorithm.filter_groups`, DAPO) or `rollout.score_while_generating` the
rollout task scores its groups as they are generated (tasks/loop/prompts.py `dynamic_sampling`, where
generation runs), and this task passes the scored table through.
"""

from __future__ import annotations

import pandas as pd
from flytekit import task

from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.run.common import check_columns, config_of, stage
from tasks.actors.pools import check_reward_errors, reward_metrics, score_table, with_rewards
from tasks.run.types import RunSpec


def score_batch(spec: RunSpec, batch: pd.DataFrame, iteration: int) -> pd.DataFrame:
    """The scoring stage: rewards for every row and the reward/* metrics of these samples."""
    check_columns(batch, "rollout", at="entering scoring")
    metrics: dict[str, float] = {}
    with stage(spec, "scoring", iteration, metrics):
        df = with_rewards(batch, *score_table(spec, batch))
        check_columns(df, "rollout", "scoring", at="leaving scoring")
        metrics.update(reward_metrics(df))
    check_reward_errors(config_of(spec).reward, df, f"iteration {iteration}'s scoring")   # after its metrics are logged
    return df


@task(task_config=ray_job("scoring"), **task_resources("scoring"))
def score(spec: RunSpec, batch: pd.DataFrame, iteration: int) -> pd.DataFrame:
    """Adds `reward` and `reward_error` to every row. A table that already has them was scored
    (with `algorithm.filter_groups` or `rollout.score_while_generating`, by the rollout task's
    scheduler): it passes through as is."""
    if "reward" in batch.columns:
        check_columns(batch, "rollout", "scoring", at="entering scoring (scored by the rollout's scheduler)")
        return batch
    return score_batch(spec, batch, iteration)
