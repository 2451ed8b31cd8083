"""The default preset's settings as plain values, for the engine-level benchmarks
(benchmarks/gpu_rl_check.py, benchmarks/gpu_mfu.py) that run where pydantic and configs/ are not
installed (a lent GPU box). The one place to switch after the algorithm config moves to
engines/algorithms/config.py; tests/benchmarks/test_gpu_rl_check.py checks every value against configs/tiny.yaml
as the config schema loads it."""

from __future__ import annotations

import types

# engines/algorithms/config.py's defaults with configs/tiny.yaml's `algorithm:` section over them (GRPO,
# PPO-clip, k3 KL loss with beta 0.001). Plain values: no pydantic on the GPU box. After the move of
# the config to engines/algorithms/config.py, `algorithm()` may build that class instead.
ALGORITHM = {
    "advantage": "grpo", "distill_reward_weight": 0.0, "norm_adv_by_std": True, "gamma": 1.0, "lam": 1.0, "reinforce_baseline": "batch",
    "reinforce_ema_decay": 0.9, "whiten_advantages": False, "adv_clip": None, "gigpo_step_weight": 1.0,
    "policy_loss": "ppo_clip", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": None,
    "loss_agg_mode": "token-mean", "loss_scale_factor": None, "tis_cap": None, "tis_level": "token",
    "old_logprobs": "auto", "ppo_epochs": 1, "cliprange_value": 0.5, "critic_lr": 0.001, "critic_warmup_iterations": 0,
    "kl_estimator": "k3", "kl_coef": 0.001, "use_kl_loss": True, "kl_ctrl": "fixed", "kl_target": 0.1,
    "kl_horizon": 10000, "entropy_coef": 0.0, "skip_zero_advantage": True, "reward_norm": "none", "reward_clip": None,
    "overlong_buffer_len": 0, "overlong_max_len": None, "overlong_penalty_factor": 1.0, "mask_truncated": False,
    "difficulty_low": 0.0, "difficulty_high": 1.0, "filter_groups": False, "max_generation_rounds": 4,
}
# configs/tiny.yaml (the default preset) and configs/schema.py's defaults for what it leaves out
PRESET = {
    "bootstrap": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "max_positions": 256, "steps": 1500,
                  "batch_size": 64, "lr": 3e-3, "num_examples": 40000, "teacher_accuracy": 0.4},
    "rollout": {"prompts_per_iteration": 64, "samples_per_prompt": 8, "temperature": 1.0, "max_new_tokens": 12},
    "training": {"lr": 5e-4, "mini_batch_size": 256, "max_tokens_per_micro_batch": 8192, "weight_decay": 0.0,
                 "grad_clip": 1.0},
    "loop": {"iterations": 20, "eval_every": 5},
    "eval_size": 256,
    "seed": 0,
}
SMOKE_PRESET = {**PRESET, "bootstrap": {**PRESET["bootstrap"], "steps": 40, "batch_size": 32, "num_examples": 2000},
                "rollout": {**PRESET["rollout"], "prompts_per_iteration": 8, "samples_per_prompt": 4},
                "training": {**PRESET["training"], "mini_batch_size": 16},
                "loop": {"iterations": 2, "eval_every": 1}, "eval_size": 16}


def algorithm(**overrides) -> types.SimpleNamespace:
    """What the training engine and engines/training/rl_step.py read as `cfg` (attribute access only)."""
    unknown = set(overrides) - set(ALGORITHM)
    if unknown:
        raise ValueError(f"unknown algorithm settings {sorted(unknown)}")
    return types.SimpleNamespace(**{**ALGORITHM, **overrides})
