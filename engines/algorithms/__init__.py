"""RL algorithms as pure functions over tensors, chosen by name through registries.

The trainer uses the config bridge (``objective``); the registered functions and helpers are
re-exported for tests, benchmarks and new variants. See docs/algorithms.md.
"""

from engines.algorithms.registry import (
    ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage,
    get_kl,
    get_policy_loss,
    register_advantage,
    register_kl,
    register_policy_loss,
)
from engines.algorithms.aggregate import LOSS_AGG_MODES, agg_loss, global_counts, masked_mean, masked_sum
from engines.algorithms import advantages, critic, kl, normalize, policy_losses, shaping  # noqa: F401  (registers)
from engines.algorithms import gigpo  # noqa: F401  (registers)
from engines.algorithms.critic import value_loss
from engines.algorithms.kl import AdaptiveKLController, FixedKLController, adaptive_kl_coef
from engines.algorithms.normalize import RunningStats, masked_whiten, normalize_rewards
from engines.algorithms.policy_losses import truncated_is_weights
from engines.algorithms.shaping import (
    difficulty_mask,
    filter_groups,
    mask_truncated,
    overlong_penalty,
    scores_to_token_rewards,
    truncated_from_finish_reason,
)
from engines.algorithms.objective import (
    actor_loss,
    apply_kl_penalty,
    compute_advantages,
    critic_loss,
    make_kl_controller,
    select_groups,
    shape_rewards,
)

__all__ = [
    "ADVANTAGES", "KL_ESTIMATORS", "POLICY_LOSSES", "LOSS_AGG_MODES",
    "register_advantage", "register_policy_loss", "register_kl",
    "get_advantage", "get_policy_loss", "get_kl",
    "agg_loss", "global_counts", "masked_mean", "masked_sum", "masked_whiten",
    "value_loss", "truncated_is_weights",
    "AdaptiveKLController", "FixedKLController", "adaptive_kl_coef",
    "RunningStats", "normalize_rewards",
    "difficulty_mask", "filter_groups", "mask_truncated", "overlong_penalty",
    "scores_to_token_rewards", "truncated_from_finish_reason",
    "compute_advantages", "actor_loss", "apply_kl_penalty", "critic_loss",
    "shape_rewards", "select_groups", "make_kl_controller",
]
