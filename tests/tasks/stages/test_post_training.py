"""What an SFT or DPO run decides before any cluster (tasks/stages/post_training.py): which workflow a
config belongs to, the RL-only settings it refuses, the step schedule (the same rows after a resume),
and the examples over the token limit (dropped with a report, or refused naming them)."""

from __future__ import annotations

import pandas as pd
import pytest

from configs.schema import ConfigError, load_config
from configs.checks import check_kind, rl_only_settings
from tasks.stages.post_training import bound_rows, step_rows, total_steps

SFT, DPO, RL = "configs/sft_tiny.yaml", "configs/dpo_tiny.yaml", "configs/tiny.yaml"


def test_each_workflow_takes_its_own_configs_only():
    check_kind(load_config(SFT), "sft")
    check_kind(load_config(DPO), "dpo")
    check_kind(load_config(RL), "rl")
    with pytest.raises(ValueError, match=r"sets the sft section.*workflows/sft.py"):
        check_kind(load_config(SFT), "rl")
    with pytest.raises(ValueError, match=r"workflows/dpo.py needs the config's dpo section"):
        check_kind(load_config(SFT), "dpo")
    with pytest.raises(ValueError, match="one run is one kind"):
        check_kind(load_config(SFT, ["dpo.train_uri=x.jsonl"]), "sft")


def test_rl_only_settings_are_refused_by_name():
    cfg = load_config(SFT, ["algorithm.kl_coef=0.5", "training.mini_batch_size=8", "data.domains=[reverse]",
                            "rollout.max_new_tokens=20", "data.max_line_bytes=1000"])
    assert rl_only_settings(cfg) == ["algorithm.kl_coef", "training.mini_batch_size", "data.domains"]
    with pytest.raises(ValueError, match=r"does not use the RL setting\(s\) algorithm.kl_coef, training.mini_batch_size"):
        check_kind(cfg, "sft")


def test_section_refusals_at_config_load():
    with pytest.raises(ConfigError, match="both say how long to train"):
        load_config(SFT, ["sft.steps=10", "sft.epochs=2"])
    with pytest.raises(ConfigError, match="not used by loss 'ipo'"):
        load_config(DPO, ["dpo.loss=ipo", "dpo.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="sft.train_uri"):
        load_config(SFT, ["sft.train_uri=''"])


def test_schedule_is_a_stream_of_epochs_and_resumes_to_the_same_rows():
    whole = step_rows(10, 4, seed=3, first=0, count=6)
    assert all(len(s) == 4 for s in whole)
    stream = [j for s in whole for j in s]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))   # each epoch: every row once
    assert stream[:10] != stream[10:20]                                                          # a fresh order per epoch
    assert step_rows(10, 4, seed=3, first=4, count=2) == whole[4:]                               # version 3 of 2 steps, resumed
    assert step_rows(10, 4, seed=4, first=0, count=1) != whole[:1]
    cfg = load_config(SFT, ["sft.epochs=3", "sft.batch_size=4"])
    assert total_steps(cfg.sft, 10) == 9
    assert total_steps(load_config(SFT, ["sft.steps=5"]).sft, 10) == 5


def test_long_examples_are_dropped_with_a_report_or_refused_by_row():
    df = pd.DataFrame({"prompt": ["a", "bbbbbbbb", "c"]})
    kept, long = bound_rows(df, [5, 40, 7], 10, "drop", "sft.max_tokens", "train", "d.jsonl")
    assert list(kept["prompt"]) == ["a", "c"] and long == ["train row 2 (40 tokens, prompt 'bbbbbbbb')"]
    with pytest.raises(ValueError, match=r"sft.max_tokens: 1 example\(s\) of 'd.jsonl' are longer than 10 tokens.*train row 2"):
        bound_rows(df, [5, 40, 7], 10, "refuse", "sft.max_tokens", "train", "d.jsonl")


def test_on_policy_pairs_are_each_groups_best_and_worst():
    from tasks.stages.post_training import best_worst_pairs

    df = pd.DataFrame({
        "group_id": ["1:a"] * 3 + ["1:b"] * 2 + ["1:c"] * 2,
        "reward": [0.0, 1.0, 0.5, 1.0, 1.0, 0.2, 0.0],
        "prompt_token_ids": [[5, 6]] * 3 + [[7]] * 2 + [[8, 9]] * 2,
        "response_token_ids": [[1], [2, 2], [3], [4], [4, 4], [5, 1], [6]],
    })
    pairs, counts = best_worst_pairs(df)
    assert counts == {"dpo/pairs": 2.0, "dpo/groups_without_preference": 1.0, "dpo/reward_gap": pytest.approx(0.6)}
    (ca, ra), (cc, rc) = pairs
    assert (ca.prompt_ids, ca.response_ids, ra.response_ids) == ([5, 6], [2, 2], [1])
    assert (cc.prompt_ids, cc.response_ids, rc.response_ids) == ([8, 9], [5, 1], [6])
    assert ca.loss_mask == [1, 1] and rc.loss_mask == [1]


def test_on_policy_dpo_reads_the_data_section_and_refuses_file_settings():
    on = "configs/dpo_on_policy_tiny.yaml"
    check_kind(load_config(on), "dpo")               # data.domains, rollout.prompts_per_iteration: read by its rounds
    with pytest.raises(ConfigError, match=r"dpo.steps belong to a pairs file"):
        load_config(on, ["dpo.steps=5"])
    with pytest.raises(ConfigError, match=r"dpo.train_uri: pairs=file needs the preference file"):
        load_config(on, ["dpo.pairs=file", "dpo.rounds=0"])
    with pytest.raises(ConfigError, match=r"dpo.rounds=3 counts on-policy sampling rounds"):
        load_config(DPO, ["dpo.rounds=3"])
    with pytest.raises(ValueError, match=r"does not use the RL setting\(s\) algorithm.kl_coef"):
        check_kind(load_config(on, ["algorithm.kl_coef=0.1"]), "dpo")
