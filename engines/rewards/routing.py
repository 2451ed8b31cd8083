"""Which reward scores a sample, and scoring a batch of samples with it.

This is the one scoring path: training's reward workers (tasks/actors/reward.py `RewardWorker.score`)
and evaluation (the workflow's eval task through those same workers, `flyroll eval` and
engines/rewards/evaluation.py in-process) all call `score_samples`, so a row earns the same reward in
training and in eval.

Routing (`reward_name`), first match wins:
1. `routes[domain]` -- config `reward.functions`;
2. `sample["metadata"]["reward_fn"]` -- set by make_dataset when a `data.sources` entry relabels its
   rows' domain (e.g. reasoning-gym tasks labelled `math` keep the `reasoning_gym` scorer);
3. the domain's own name.

A name in `MODEL_REWARDS` (`judge`, `reward_model`) is scored in batches by `ModelRewards` with
its config section (`reward.judge` / `reward.reward_model`); any other name is a reward
function (`get_reward`: registered name or "package.module:function"), each call isolated by
`score_isolated` (timeout, exception -> 0.0 and the error kept).
"""

from __future__ import annotations

import concurrent.futures as cf
import typing

from engines.rewards import get_reward, score_isolated
from engines.rewards.models import MODEL_REWARDS, ModelRewards, RewardPlacement
from engines.sandbox.runner import configure

if typing.TYPE_CHECKING:  # annotations only: scoring runs without pydantic (engines/rewards/config.py)
    from engines.rewards.config import RewardConfig

# (domain, response, sample) -> one scored item; sample holds prompt, answer, tests, metadata
Item = tuple[str, str, dict]


class Scored(tuple):
    """One item's (reward, error), plus `isolation`: the sandbox mode that ran it (code reward) or None."""

    isolation: str | None = None

    def __new__(cls, reward: float, error: str | None, isolation: str | None = None) -> "Scored":
        obj = super().__new__(cls, (reward, error))
        obj.isolation = isolation
        return obj

    def __reduce__(self):
        return Scored, (self[0], self[1], self.isolation)


def reward_name(domain: str, sample: dict, routes: dict[str, str] | None = None) -> str:
    """The reward that scores `sample` of `domain`: routes[domain], else metadata.reward_fn, else domain."""
    meta = sample.get("metadata") if isinstance(sample.get("metadata"), dict) else {}
    return (routes or {}).get(domain) or meta.get("reward_fn") or domain


def check_reward(name: str, reward: RewardConfig) -> None:
    """Raise KeyError naming the problem when `name` cannot score anything: an unknown or unimportable
    reward function, or a model reward whose `model` is not set in `reward`."""
    if name in MODEL_REWARDS:
        if not getattr(reward, name).model:
            raise KeyError(f"domain routes to {name!r} but reward.{name}.model is not set")
        return
    get_reward(name)


def score_samples(items: list[Item], reward: RewardConfig, pool: cf.ThreadPoolExecutor, model_rewards: ModelRewards,
                  placement: RewardPlacement = RewardPlacement()) -> tuple[list[tuple[float, str | None]], bool]:
    """([(reward, error)] per item, hung). hung = a reward call is still stuck in `pool` (its owner should
    be replaced). `reward`: the config's reward section -- its routes (`functions`: domain -> reward name),
    the per-call `timeout_s`, the model rewards' sections (their models built on `placement`), and the code
    sandbox's policy (`sandbox`), set for this process before anything is scored. Each result is a
    `Scored` (reward, error) that also says which sandbox mode scored it."""
    box = reward.sandbox
    configure(allow_weaker=box.allow_weaker, max_disk_mb=box.max_disk_mb, max_files=box.max_files)
    routes, timeout_s = reward.functions, reward.timeout_s
    out: list = [None] * len(items)
    batched: dict[str, list[int]] = {}   # model reward name -> indices of its items
    hung_any = False
    for i, (domain, response, sample) in enumerate(items):
        name = reward_name(domain, sample, routes)
        if name in MODEL_REWARDS:
            batched.setdefault(name, []).append(i)
            continue
        try:
            fn = get_reward(name)
        except KeyError as e:
            out[i] = Scored(0.0, str(e))
            continue
        res, hung = score_isolated(fn, response, sample, timeout_s, pool)
        hung_any |= hung
        out[i] = Scored(res.reward, res.error, res.isolation)
    for name, idx in batched.items():
        results, hung = model_rewards.score(name, getattr(reward, name), [items[i][1] for i in idx],
                                            [items[i][2] for i in idx], placement)
        hung_any |= hung
        for i, res in zip(idx, results):
            out[i] = Scored(*res)
    return out, hung_any
