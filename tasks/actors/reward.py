"""The reward actor: `RewardWorker` scores samples, each reward call isolated, inside a stage's Ray cluster."""

from __future__ import annotations

import concurrent.futures as cf
import typing

import ray

if typing.TYPE_CHECKING:  # annotations only (the actor imports at run time, inside its methods)
    from engines.rewards.config import RewardConfig
    from engines.rewards.models import RewardPlacement

# The engines are imported inside the actor's methods: a driver importing this module (to create the
# actor) loads none of them.


@ray.remote
class RewardWorker:
    """Scores samples with the reward routed to them (engines/rewards/routing.py: reward.functions,
    metadata.reward_fn, the domain), each reward-function call in one of `reward.processes` worker
    processes it keeps (engines/rewards/calls.py: a call past its timeout is killed). Domains routed to a
    model reward (`judge`, `reward_model`) are scored in batches by a model this actor builds once,
    on first use, and keeps (engines/rewards/models.py)."""

    def __init__(self, threads: int = 4):
        from engines.rewards.models import ModelRewards
        from tasks.actors.process import actor_process

        actor_process()   # its creator's CPU priority, before its reward processes start (they inherit it)

        self.pool = cf.ThreadPoolExecutor(max_workers=threads)   # the model rewards' timed calls
        self.model_rewards = ModelRewards(self.pool)
        self.calls = None   # engines/rewards/calls.py RewardCalls: the reward functions' worker processes

    def score(self, items: list[tuple[str, str, dict]], reward: RewardConfig,
              placement: RewardPlacement) -> tuple[list[tuple[float, str | None]], bool]:
        """items: (domain, response, sample) -> ([(reward, error)], hung). hung = a call is still stuck.
        `reward`: the config's reward section (routes, timeout, model rewards, sandbox); `placement`:
        the reward role's device and dtype, where the model rewards load."""
        from engines.rewards.calls import RewardCalls
        from engines.rewards.routing import score_samples

        if self.calls is None or self.calls.processes != reward.processes:
            if self.calls is not None:
                self.calls.close()
            self.calls = RewardCalls(reward.processes)
        return score_samples(items, reward, self.calls, self.model_rewards, placement)

    def model_stats(self) -> dict[str, dict[str, int]]:
        """Per model reward: builds (model loads), calls (batched calls) and samples scored so far."""
        return self.model_rewards.stats
