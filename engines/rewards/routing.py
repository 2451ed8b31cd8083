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
function (`get_reward`: registered name or "package.module:function"), each call in a worker process
(engines/rewards/calls.py: timeout, crash, exception or a value that is not a finite number in bounds
-> 0.0 and the error kept). `check_error_rate` fails a batch whose domain fails too often;
`check_routes` refuses data with a domain nothing can score.
"""

from __future__ import annotations

import typing

from engines.rewards import get_reward
from engines.rewards.calls import NOT_RUN, Call, Limits, RewardCalls, check_value
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


def score_samples(items: list[Item], reward: RewardConfig, calls: RewardCalls, model_rewards: ModelRewards,
                  placement: RewardPlacement = RewardPlacement()) -> tuple[list[Scored], bool]:
    """([Scored (reward, error)] per item, hung). hung = a model reward's call is still stuck in its
    thread (the owner should be replaced). `reward`: the config's reward section -- its routes
    (`functions`), the calls' limits (`timeout_s`, `budget_s`, `max_abs`, `bounds`), the model rewards'
    sections (their models built on `placement`) and the code sandbox's policy (`sandbox`). Reward
    functions run in `calls`' worker processes, all of this batch's at once; each result also says
    which sandbox mode scored it."""
    box = reward.sandbox
    sandbox = {"allow_weaker": box.allow_weaker, "max_disk_mb": box.max_disk_mb, "max_files": box.max_files}
    configure(**sandbox)   # for the model rewards, which run in this process
    limits = Limits(timeout_s=reward.timeout_s, budget_s=reward.budget_s, bounds=(-reward.max_abs, reward.max_abs),
                    sandbox=sandbox, max_error_rate=reward.max_error_rate)
    out: list = [None] * len(items)
    batched: dict[str, list[int]] = {}   # model reward name -> indices of its items
    queued: list[tuple[int, Call]] = []
    for i, (domain, response, sample) in enumerate(items):
        name = reward_name(domain, sample, reward.functions)
        if name in MODEL_REWARDS:
            batched.setdefault(name, []).append(i)
            continue
        try:
            fn = get_reward(name)
        except KeyError as e:
            out[i] = Scored(0.0, str(e))
            continue
        queued.append((i, Call(name, fn, response, sample)))
    for (i, _), res in zip(queued, calls.run([c for _, c in queued], limits)):
        out[i] = Scored(res.reward, res.error, res.isolation)
    hung_any = False
    for name, idx in batched.items():
        results, hung = model_rewards.score(name, getattr(reward, name), [items[i][1] for i in idx],
                                            [items[i][2] for i in idx], placement)
        hung_any |= hung
        for i, res in zip(idx, results):
            out[i] = Scored(*res)
    for i, (domain, _, _) in enumerate(items):   # every value, model rewards' too: finite and within bounds
        reward_value, error = out[i]
        if error is None:
            try:
                check_value(reward_value, reward.bounds.get(domain, limits.bounds))
            except (TypeError, ValueError) as e:
                out[i] = Scored(0.0, f"{type(e).__name__}: {e}", out[i].isolation)
    return out, hung_any


class RewardErrorRate(RuntimeError):
    """A domain's reward failed on more than reward.max_error_rate of a batch's rows."""


def check_error_rate(rows: list[tuple[str, dict, str | None]], reward: RewardConfig, where: str) -> dict[str, int]:
    """Errors per domain of a scored batch, `rows` = (domain, sample, reward_error) per row. Raises
    RewardErrorRate when a domain's share of errors is over `reward.max_error_rate`, naming the reward
    function, the domain, the share and one example error; `where` says which batch ("iteration 3's
    scoring")."""
    counts: dict[str, list[int]] = {}
    example: dict[str, tuple[str, str]] = {}
    for domain, sample, error in rows:
        n = counts.setdefault(domain, [0, 0])
        n[0] += 1
        if error is not None:
            n[1] += 1
            if domain not in example or NOT_RUN in example[domain][1]:   # a real failure is the better example
                example[domain] = (reward_name(domain, sample, reward.functions), str(error))
    for domain, (total, failed) in sorted(counts.items()):
        if failed and failed / total > reward.max_error_rate:
            name, error = example[domain]
            raise RewardErrorRate(
                f"{where}: the reward of domain {domain!r} (function {name!r}) failed on {failed} of {total} rows "
                f"({failed / total:.0%}, over reward.max_error_rate {reward.max_error_rate:g}); for example: {error[:300]}. "
                f"Fix the function (or its route in reward.functions), or raise reward.max_error_rate to train on "
                "the rows it scores")
    return {domain: failed for domain, (_, failed) in counts.items()}


def check_routes(rows, reward: RewardConfig, source: str) -> None:
    """Raise ValueError naming every domain of `rows` ((domain, sample) pairs; a sample's metadata may name
    its reward_fn) that no reward can score -- an unknown or unimportable function, or a model reward
    without its model -- before anything is generated. `source` names the data ("data.sources")."""
    names = {(str(domain), reward_name(str(domain), sample if isinstance(sample, dict) else {}, reward.functions))
             for domain, sample in rows}
    problems = []
    for domain, name in sorted(names):
        try:
            check_reward(name, reward)
        except KeyError as e:
            via = "" if name == domain else f" (routed to {name!r})"
            problems.append(f"domain {domain!r}{via}: {e.args[0]}")
    if problems:
        raise ValueError(f"{source}: no reward can score " + "; ".join(problems) +
                       ". Route the domain to a reward in reward.functions ({domain: registered name or "
                       "'package.module:function'}) or register one under the domain's name")
