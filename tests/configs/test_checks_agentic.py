"""An agentic config (env set) refuses the RLVR-only options its workflow would ignore, naming the field."""

from __future__ import annotations

import pytest

from configs.schema import ConfigError, load_config
from tests.support.workflow import REPO

PRESET = REPO / "configs" / "frozenlake.yaml"

REFUSED = [
    ("algorithm.filter_groups=true", "algorithm.filter_groups"),
    ("algorithm.mask_truncated=true", "algorithm.mask_truncated"),
    ("rollout.chunk_prompts=2", "rollout.chunk_prompts"),
    ("loop.eval_samples=4", "loop.eval_samples"),
    ('data.domain_weights={"arithmetic": 1.0}', "data.domain_weights"),
    ("data.max_prompt_tokens=64", "data.max_prompt_tokens"),
    ("reward.num_workers=2", "reward.num_workers"),
    ('reward.functions={"frozenlake": "exact"}', "reward.functions"),
    ("rollout.partial_rollout_max_split=2", "rollout.partial_rollout_max_split"),
    ("rollout.score_while_generating=true", "rollout.score_while_generating"),
    ("loop.fuse=2", "loop.fuse"),
]


@pytest.mark.parametrize("override,field", REFUSED, ids=[f for _, f in REFUSED])
def test_agentic_config_refuses_rlvr_only_option(override, field):
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, [override, "algorithm.tis_cap=2.0"])
    assert field in str(info.value)


def test_filter_groups_is_allowed_with_env_workers():
    cfg = load_config(PRESET, ["algorithm.filter_groups=true", "env.workers=2"])
    assert cfg.algorithm.filter_groups and cfg.env.workers == 2
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, ["algorithm.filter_groups=true"])
    assert "algorithm.filter_groups" in str(info.value) and "env.workers > 0" in str(info.value)


def test_off_policy_steps_is_allowed_with_truncated_importance_sampling():
    """pipeline.off_policy_steps works in the agentic workflow (tests/e2e/test_agentic_workflow.py); like
    RLVR's it needs algorithm.tis_cap, which needs old_logprobs other than the preset's 'behaviour'."""
    cfg = load_config(PRESET, ["pipeline.off_policy_steps=1", "algorithm.tis_cap=2.0", "algorithm.old_logprobs=recompute"])
    assert cfg.pipeline.off_policy_steps == 1 and cfg.env is not None
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, ["pipeline.off_policy_steps=1"])
    assert "algorithm.tis_cap" in str(info.value)
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, ["pipeline.off_policy_steps=1", "algorithm.tis_cap=2.0"])  # the preset's old_logprobs: behaviour
    assert "old_logprobs" in str(info.value)


def test_same_options_still_load_for_rlvr():
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["algorithm.filter_groups=true", "algorithm.mask_truncated=true",
                                                        "rollout.chunk_prompts=2", "loop.eval_samples=4"])
    assert cfg.env is None and cfg.algorithm.filter_groups and cfg.rollout.chunk_prompts == 2


def test_agentic_refusal_lists_every_field_at_once():
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, ["algorithm.filter_groups=true", "loop.eval_samples=2"])
    assert "algorithm.filter_groups" in str(info.value) and "loop.eval_samples" in str(info.value)
    assert "dynamic sampling" in str(info.value)


@pytest.mark.parametrize("field", ["worker_cpus=2", "worker_memory=1Gi", "worker_concurrency=4", "step_timeout_s=5", "max_retries=3",
                                   "extra_groups=2"])
def test_env_pool_options_need_env_workers(field):
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, [f"env.{field}"])
    assert f"env.{field.split('=')[0]}" in str(info.value) and "env.workers: 0" in str(info.value)
    cfg = load_config(PRESET, ["env.workers=2", f"env.{field}"])
    assert cfg.env.workers == 2


def test_env_workers_out_of_range_is_refused():
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, ["env.workers=-1"])
    assert "env.workers" in str(info.value)


@pytest.mark.parametrize("value", ["512MB", "1.5G", "lots", "-1Gi"])
def test_malformed_env_worker_memory_is_refused_naming_the_field(value):
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(PRESET, ["env.workers=2", f"env.worker_memory={value}"])
    assert "env.worker_memory" in str(info.value)


@pytest.mark.parametrize("preset,bad,said,good", [
    ("webshop_smollm2.yaml", "env.kwargs.reward=partial", "reward='partial'", "env.kwargs.reward=success"),  # out of range
    ("webshop_smollm2.yaml", "env.kwargs.rewrad=success", "rewrad", "env.kwargs.reward=success"),            # misspelt
    ("frozenlake.yaml", "env.kwargs.size=1", "size", "env.kwargs.size=5"),
])
def test_env_options_the_environment_refuses_fail_at_load_naming_env_kwargs(preset, bad, said, good):
    """env.kwargs are the environment's constructor options: one it refuses fails when the config
    loads (before a model import or a warm start), naming env.kwargs and the option; a good one loads."""
    with pytest.raises((ConfigError, ValueError)) as info:
        load_config(REPO / "configs" / preset, [bad])
    assert "env.kwargs" in str(info.value) and said in str(info.value)
    assert load_config(REPO / "configs" / preset, [good]).env.kwargs[good.split("=")[0].rsplit(".", 1)[1]] is not None
