"""What each iteration is given: the prompt stream of the train split (or, for agentic runs, the
environment seeds), and with dynamic sampling the stream that refills the batch.

The rollout draws its B prompts as consecutive slices of per-epoch shuffles (`iteration_prompts`,
`stream_prompts`; partial rollout reads the same stream by position). With dynamic sampling
(`algorithm.filter_groups`, DAPO arXiv 2503.14476) the rollout task runs the rollout scheduler
(engines/generation/scheduler.py) through `dynamic_sampling`: chunks of prompts go to its generation actors
(tasks/actors/pools.py `RayGeneration`), each generated group goes to the reward workers at once
(`RayRewards`), and the groups that fail the filters (`group_filters`: all rewards equal; with
`mask_truncated`, all samples truncated; with a difficulty band, mean reward outside it) are
dropped, until the batch holds `rollout.prompts_per_iteration` kept groups or the prompt budget,
`prompts_per_iteration * algorithm.max_generation_rounds` prompts, is spent; then it trains on what
it has (on the first scored groups, unfiltered, when none passes). Prompts after the rollout's own
batch are drawn by `refill_prompts` (with `data.domain_weights` when they are set). This runs where
generation runs, in the rollout task (its Ray cluster is the one sized for the generation actors;
one created in the scoring task would ask the scoring cluster for a GPU it does not have), and the
`score` task passes the scored table through. With `rollout.score_while_generating` (and no filter)
the same scheduler runs over the rollout's own B prompts only: every group is kept, and the point
is that each is scored while later chunks (`rollout.chunk_prompts`) still generate.
"""

from __future__ import annotations

import glob

import numpy as np
import pandas as pd

from engines.data.datasets import decode_nested, encode_nested
from engines.data.prompt_mix import mix_domains, split_by_domain
from engines.generation.scheduler import DROPPED, RolloutScheduler, group_filters
from engines.rewards.routing import RewardErrorRate
from tasks.run.common import config_of, console, fetch_cached, log_iteration_metrics
from tasks.actors.pools import RayRewards, check_reward_errors, reward_metrics, with_rewards
from tasks.run.seeds import epoch_order_seed, prompt_mix_seed, refill_stream_seed
from tasks.run.types import RunSpec

def read_table(spec: RunSpec, key: str) -> pd.DataFrame:
    """A published prompt table (train or eval split), nested columns decoded."""
    (path,) = glob.glob(f"{fetch_cached(spec, key)}/*.parquet")
    df = pd.read_parquet(path)
    for col in ("answer", "tests", "metadata"):
        if col not in df.columns:
            df[col] = None
    return decode_nested(df)


def iteration_prompts(train: pd.DataFrame, batch: int, iteration: int, seed: int) -> pd.DataFrame:
    """Prompts of iteration `iteration` (1-based): consecutive slices of a per-epoch shuffle, so every
    prompt is used once per epoch and the choice is reproducible from (seed, iteration)."""
    return stream_prompts(train, (iteration - 1) * batch, batch, seed)


def stream_prompts(train: pd.DataFrame, start: int, count: int, seed: int) -> pd.DataFrame:
    """Positions start..start+count-1 of the prompt stream: per-epoch shuffles of `train`, one after
    another (epoch e is permutation `epoch_order_seed(seed, e)`)."""
    rows = []
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, len(train))
        order = np.random.default_rng(epoch_order_seed(seed, epoch)).permutation(len(train))
        rows.append(int(order[offset]))
    return train.iloc[rows].reset_index(drop=True)


def refill_prompts(cfg, train: pd.DataFrame, n: int, iteration: int, round_: int) -> pd.DataFrame:
    """Candidate prompts for the `round_`-th refill draw of `iteration` (1 = the first, after the
    rollout's own batch; see `prompt_stream`): a fresh draw mixed by
    `data.domain_weights` (per-domain quotas, as the rollout draws its batch) when weights are set,
    else a slice of a per-round reshuffle of the train split. The caller drops prompts already used
    this iteration, so the kept mix can differ from the weights by those."""
    if cfg.data.domain_weights:  # the rollout's own draw is round 0
        return mix_domains(split_by_domain(train), dict(cfg.data.domain_weights), n,
                           seed=prompt_mix_seed(cfg.run.seed, iteration, round_)).reset_index(drop=True)
    return iteration_prompts(train, n, iteration, refill_stream_seed(cfg.run.seed, round_))


def prompt_stream(cfg, first: pd.DataFrame, train: pd.DataFrame, iteration: int):
    """Prompt-table rows for the scheduler: the rollout's own batch, then `max_generation_rounds - 1`
    refill draws (`refill_prompts`), each prompt at most once per iteration (group ids stay unique)."""
    used: set = set()
    for round_ in range(cfg.algorithm.max_generation_rounds):
        batch = first if round_ == 0 else refill_prompts(cfg, train, cfg.rollout.prompts_per_iteration, iteration, round_)
        for _, p in batch.iterrows():
            if p["prompt_id"] not in used:
                used.add(p["prompt_id"])
                yield p


def dynamic_sampling(spec: RunSpec, generation, prompts: pd.DataFrame, train: pd.DataFrame,
                     iteration: int) -> tuple[pd.DataFrame, dict[str, float]]:
    """The scored table of up to `rollout.prompts_per_iteration` groups that pass `group_filters`,
    and its metrics (module doc). `generation`: a `GenerationSide` (tasks/actors/pools.py `RayGeneration`)
    serving the policy; `prompts`: the rollout's own batch; `train`: the split refills draw from.
    `reward/*` metrics describe every scored sample, kept or dropped."""
    cfg = config_of(spec)
    want, workers = cfg.rollout.prompts_per_iteration, cfg.rollout.num_workers
    filters = group_filters(cfg.algorithm)
    rewards = RayRewards(spec)
    try:  # without filters every group is kept: the budget is the batch itself, never a refill
        result = RolloutScheduler(generation, rewards, filters, want=want,
                                  max_prompts=want * cfg.algorithm.max_generation_rounds if filters else want,
                                  chunk_size=cfg.rollout.chunk_prompts or -(-want // workers),
                                  max_chunks_in_flight=workers).run(
            prompt_stream(cfg, prompts, train, iteration))
    finally:
        rewards.close()
    groups = result.kept
    if not groups:
        console.print("[yellow]dynamic sampling: no group passed the filters within the prompt budget; training on "
                      "the first scored groups, unfiltered[/]")
        groups = [g for g in result.groups if g.status == DROPPED][:want]

    def table(gs) -> pd.DataFrame:
        scored = [(r, x, e) for g in gs for r, x, e in zip(g.rows, g.rewards, g.errors)]
        return with_rewards(encode_nested(pd.DataFrame([r for r, _, _ in scored])),
                            [x for _, x, _ in scored], [e for _, _, e in scored])

    scored = table([g for g in result.groups if g.rewards])
    metrics = {**reward_metrics(scored), **result.metrics(want)}
    try:
        check_reward_errors(cfg.reward, scored, f"iteration {iteration}'s scoring (while generating)")
    except RewardErrorRate:
        log_iteration_metrics(spec, iteration, metrics)   # the failing batch's reward/* metrics, then the failure
        raise
    if not filters:  # nothing was filtered: the dynamic_sampling/* counts would only restate the batch
        metrics = {k: v for k, v in metrics.items() if not k.startswith("dynamic_sampling/")}
    return table(groups), metrics
