"""The typed config: defaults, YAML loading, overrides, and errors that name the field, the value and
what was expected."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from configs.schema import DEFAULT_CONFIG, ConfigError, FlyrollConfig, load_config, parse_config


def write(tmp_path, text: str, name: str = "preset.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(tmp_path, text: str, overrides: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    return str(info.value)


# --- valid configs ----------------------------------------------------------------------------

def test_defaults_validate():
    cfg = parse_config({})
    assert isinstance(cfg, FlyrollConfig)
    assert cfg == FlyrollConfig()
    assert cfg.algorithm.advantage == "grpo" and cfg.rollout.samples_per_prompt >= 2
    assert parse_config(None) == cfg


def test_default_preset_validates():
    if not DEFAULT_CONFIG.exists():
        pytest.skip(f"{DEFAULT_CONFIG.name} is not written yet")
    assert isinstance(load_config(), FlyrollConfig)


def test_yaml_values_are_applied(tmp_path):
    cfg = load_config(write(tmp_path, "run:\n  name: exp\nrollout:\n  temperature: 0.7\n  stop: [\"\\n\"]\n"
                                      "algorithm:\n  advantage: rloo\n  loss_agg_mode: seq-mean-token-mean\n"))
    assert cfg.run.name == "exp" and cfg.rollout.temperature == 0.7 and cfg.rollout.stop == ("\n",)
    assert cfg.algorithm.advantage == "rloo" and cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"
    assert cfg.training == FlyrollConfig().training  # untouched sections keep their defaults
    assert load_config(write(tmp_path, "{}\n")) == FlyrollConfig()  # an explicit empty mapping is all defaults (an empty file is refused)


def test_overrides(tmp_path):
    path = write(tmp_path, "rollout:\n  temperature: 0.7\n")
    cfg = load_config(path, {"rollout.temperature": 0.3, "training.lr": 1e-4, "model.bootstrap.steps": 5,
                             "algorithm.advantage": "reinforce"})
    assert cfg.rollout.temperature == 0.3  # an override beats the preset
    assert cfg.training.lr == 1e-4 and cfg.model.bootstrap.steps == 5  # also in sections the preset lacks
    assert cfg.algorithm.advantage == "reinforce"
    assert load_config(path).rollout.temperature == 0.7  # the file is not modified
    # overrides are validated like the file
    assert "rollout.temprature" in config_error(tmp_path, "{}\n", {"rollout.temprature": 0.5})
    assert "rollout.temperature" in config_error(tmp_path, "{}\n", {"rollout.temperature": -1})


def test_override_into_an_empty_section(tmp_path):
    """BUG (configs/schema.py, load_config): a section written with no keys (`rollout:` -> None)
    makes an override into it crash with a bare TypeError instead of applying it."""
    cfg = load_config(write(tmp_path, "rollout:\n"), {"rollout.temperature": 0.5})
    assert cfg.rollout.temperature == 0.5


def test_override_below_a_scalar_is_a_config_error(tmp_path):
    """BUG (configs/schema.py, load_config): `run.name.x` where run.name is a string raises a bare
    TypeError ('str' object does not support item assignment) instead of a ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"run\.name\.x"):
        load_config(write(tmp_path, "run:\n  name: exp\n"), {"run.name.x": 1})


def test_config_is_immutable():
    """Sections are frozen so that hash() keeps describing the config it was computed from.
    BUG (engines/algorithms/config.py): AlgorithmConfig is not frozen (model_config lacks frozen=True), so
    `cfg.algorithm.kl_coef = ...` silently changes a config whose hash may already name a run."""
    cfg = parse_config({})
    with pytest.raises(Exception):
        cfg.rollout.temperature = 0.1
    with pytest.raises(Exception):
        cfg.algorithm.kl_coef = 0.5


# --- errors -----------------------------------------------------------------------------------

def test_unknown_key_names_the_dotted_field(tmp_path):
    msg = config_error(tmp_path, "rollout:\n  temprature: 0.5\n")
    assert "rollout.temprature" in msg and "unknown key" in msg and "0.5" in msg
    assert "preset.yaml" in msg  # the source file
    assert "nosuchsection" in config_error(tmp_path, "nosuchsection:\n  a: 1\n")


def test_wrong_type_names_field_and_value(tmp_path):
    msg = config_error(tmp_path, 'rollout:\n  samples_per_prompt: "eight"\n')
    assert "rollout.samples_per_prompt" in msg and "'eight'" in msg and "integer" in msg
    assert "run" in config_error(tmp_path, "run: 3\n")  # a section that is not a mapping


def test_out_of_range_names_field(tmp_path):
    msg = config_error(tmp_path, "rollout:\n  temperature: -1\n")
    assert "rollout.temperature" in msg and "-1" in msg and "greater than or equal to 0" in msg
    assert "data.eval_size" in config_error(tmp_path, "data:\n  eval_size: 100000\n")


def test_several_errors_are_reported_together(tmp_path):
    msg = config_error(tmp_path, "rollout:\n  temperature: -1\n  top_p: 0\ntraining:\n  lr: 0\n")
    assert all(f in msg for f in ("rollout.temperature", "rollout.top_p", "training.lr"))


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="nope.yaml.*does not exist"):
        load_config(missing)


def test_invalid_yaml(tmp_path):
    assert "not valid YAML" in config_error(tmp_path, "rollout: [1, 2\n")
    assert "mapping" in config_error(tmp_path, "- 1\n- 2\n")


def test_unregistered_algorithm_name_lists_the_allowed_names(tmp_path):
    msg = config_error(tmp_path, "algorithm:\n  advantage: nope\n")
    assert "algorithm.advantage" in msg and "'nope'" in msg and "'grpo'" in msg and "'rloo'" in msg
    assert "'ppo_clip'" in config_error(tmp_path, "algorithm:\n  policy_loss: ppo\n")
    assert "'k3'" in config_error(tmp_path, "algorithm:\n  kl_estimator: k4\n")


@pytest.mark.parametrize("use_kl_loss", ["true", "false"])
def test_full_vocabulary_kl_is_refused_at_load(tmp_path, use_kl_loss):
    # the update has only the sampled tokens' reference log-probs, so 'full' could never run: the
    # config refuses it before any cluster starts, naming the field, the value and the choices
    msg = config_error(tmp_path, f"algorithm:\n  kl_estimator: full\n  use_kl_loss: {use_kl_loss}\n")
    assert "algorithm.kl_estimator = 'full' is not supported" in msg and "[B,T,V]" in msg
    assert "['abs', 'k1', 'k2', 'k3']" in msg


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_group_estimators_need_two_samples(tmp_path, advantage):
    msg = config_error(tmp_path, f"rollout:\n  samples_per_prompt: 1\nalgorithm:\n  advantage: {advantage}\n")
    assert "rollout.samples_per_prompt=1" in msg and advantage in msg and "at least 2" in msg
    cfg = load_config(write(tmp_path, "rollout:\n  samples_per_prompt: 1\nalgorithm:\n  advantage: reinforce\n"))
    assert cfg.rollout.samples_per_prompt == 1


def test_score_while_generating_is_refused_for_the_agentic_workflow(tmp_path):
    msg = config_error(tmp_path, "env:\n  name: frozenlake\nrollout:\n  score_while_generating: true\n")
    assert "rollout.score_while_generating" in msg and "agentic" in msg
    cfg = load_config(write(tmp_path, "rollout:\n  score_while_generating: true\n  chunk_prompts: 2\n"))
    assert cfg.scores_in_rollout and cfg.rollout.chunk_prompts == 2 and not FlyrollConfig().scores_in_rollout


def test_unknown_domain_is_refused(tmp_path):
    msg = config_error(tmp_path, "data:\n  domains: [arithmetic, poetry]\n")
    assert "data.domains" in msg and "poetry" in msg and "reverse" in msg


# --- identity -------------------------------------------------------------------------------

def test_hash_is_stable_and_tracks_every_field(tmp_path):
    a = load_config(write(tmp_path, "run:\n  name: x\nrollout:\n  temperature: 0.7\n", "a.yaml"))
    b = load_config(write(tmp_path, "rollout:\n  temperature: 0.7\nrun:\n  name: x\n", "b.yaml"))  # other order
    assert a.hash() == b.hash() == a.hash()
    assert len(a.hash()) == 12 and int(a.hash(), 16) >= 0
    assert parse_config({}).hash() == FlyrollConfig().hash()
    changed = {
        load_config(write(tmp_path, "run:\n  name: x\nrollout:\n  temperature: 0.8\n", "c.yaml")).hash(),
        load_config(write(tmp_path, "run:\n  name: y\nrollout:\n  temperature: 0.7\n", "d.yaml")).hash(),
        parse_config({"run": {"name": "x"}, "rollout": {"temperature": 0.7}, "algorithm": {"kl_coef": 0.01}}).hash(),
        parse_config({"run": {"name": "x"}, "rollout": {"temperature": 0.7}, "model": {"bootstrap": {"steps": 7}}}).hash(),
    }
    assert a.hash() not in changed and len(changed) == 4


def test_hash_ignores_settings_left_at_their_default():
    """A setting a newer flyroll adds (with its default) must not move the run id, or runs started before
    the upgrade could not resume: the hash covers the settings that differ from their defaults."""
    base = parse_config({"run": {"name": "x"}})
    assert parse_config({"run": {"name": "x"}, "algorithm": {"skip_zero_advantage": True}}).hash() == base.hash()
    assert parse_config({"run": {"name": "x"}, "algorithm": {"skip_zero_advantage": False}}).hash() != base.hash()


def test_flat_has_dotted_keys():
    flat = parse_config({"rollout": {"stop": ["\n"]}}).flat()
    assert flat["rollout.temperature"] == "1.0"
    assert flat["algorithm.advantage"] == "grpo"
    assert flat["model.bootstrap.hidden_size"] == "128"
    assert flat["model.path"] == "None"
    assert flat["data.domains"] == '["arithmetic", "reverse"]' and flat["rollout.stop"] == '["\\n"]'
    assert all(isinstance(v, str) for v in flat.values())
    assert not any(k.startswith(".") or ".." in k for k in flat)
    assert {k.split(".")[0] for k in flat} == set(FlyrollConfig.model_fields)


def test_every_field_is_described():
    def walk(model: type[BaseModel], prefix: str):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")

    walk(FlyrollConfig, "")


def test_training_compile_only_with_the_torch_strategy(tmp_path):
    assert parse_config({"training": {"compile": True}}).training.compile is True
    msg = config_error(tmp_path, "training:\n  compile: true\n  strategy: ddp\n  num_workers: 2\n")
    assert "training.compile is only built for strategy 'torch'" in msg
    assert "compile" in config_error(tmp_path, "training:\n  compile: layers\n")


def test_behaviour_old_logprobs_refuse_tis(tmp_path):
    assert parse_config({"algorithm": {"old_logprobs": "behaviour"}}).algorithm.old_logprobs == "behaviour"
    msg = config_error(tmp_path, "algorithm:\n  old_logprobs: behaviour\n  tis_cap: 2.0\n")
    assert "algorithm.tis_cap needs algorithm.old_logprobs = 'recompute'" in msg
    assert "old_logprobs" in config_error(tmp_path, "algorithm:\n  old_logprobs: engine\n")


# --- refusals at config time (issue 40) ----------------------------------------------------------

def test_an_empty_config_file_is_refused_naming_it(tmp_path):
    """Was: an empty file silently gave the schema's defaults (not configs/tiny.yaml)."""
    for text in ("", "\n# only a comment\n"):
        msg = config_error(tmp_path, text)
        assert "preset.yaml" in msg and "is empty" in msg


def test_a_duplicate_yaml_key_is_refused_naming_the_key_and_both_lines(tmp_path):
    """Was: YAML kept the last of the two silently."""
    msg = config_error(tmp_path, "run:\n  name: a\ntraining:\n  lr: 0.1\n  grad_clip: 1.0\n  lr: 0.2\n")
    assert "'lr'" in msg and "line 4" in msg and "line 6" in msg and "preset.yaml" in msg
    msg = config_error(tmp_path, "rollout:\n  temperature: 0.5\nrollout:\n  top_p: 0.9\n")   # a whole section twice
    assert "'rollout'" in msg and "line 1" in msg and "line 3" in msg
    assert load_config(write(tmp_path, "run: {name: a}\ntraining: {lr: 0.1}\n")).training.lr == 0.1  # same key, other mappings


@pytest.mark.parametrize("advantage, extra", [
    ("reinforce_plus_plus_baseline", ""), ("gigpo", ""), ("grpo", "  norm_adv_by_std: false\n"),  # Dr.GRPO
])
def test_every_group_baseline_estimator_refuses_one_sample_per_prompt(tmp_path, advantage, extra):
    """Was: only grpo and rloo were refused; the others trained on all-zero advantages."""
    from engines.algorithms.registry import GROUP_BASELINE

    assert advantage in GROUP_BASELINE
    msg = config_error(tmp_path, f"rollout:\n  samples_per_prompt: 1\nalgorithm:\n  advantage: {advantage}\n{extra}")
    assert "rollout.samples_per_prompt=1" in msg and advantage in msg and "at least 2" in msg


def test_estimators_without_a_group_baseline_take_one_sample_per_prompt(tmp_path):
    from engines.algorithms.registry import ADVANTAGES, GROUP_BASELINE

    for advantage in sorted(set(ADVANTAGES) - GROUP_BASELINE - {"gae"}):
        # on_policy_distill's reference is its teacher, which it requires (tests/engines/algorithms/test_advantages_on_policy_distill.py)
        teacher = "model:\n  reference_path: package:teacher\n" if advantage == "on_policy_distill" else ""
        load_config(write(tmp_path, f"{teacher}rollout:\n  samples_per_prompt: 1\nalgorithm:\n  advantage: {advantage}\n"))


def test_domain_weights_for_a_domain_absent_from_the_data_are_refused(tmp_path):
    """Was: refused only by mix_domains, in the rollout task, after Ray started."""
    msg = config_error(tmp_path, "data:\n  domains: [arithmetic]\n  domain_weights: {arithmetic: 0.5, math: 0.5}\n")
    assert "data.domain_weights" in msg and "'math'" in msg and "arithmetic" in msg
    msg = config_error(tmp_path, "data:\n  sources:\n    - {kind: ifeval}\n    - {kind: reasoning_gym, names: [chain_sum], domain: math}\n"
                                 "  domain_weights: {math: 0.5, code: 0.5}\n")
    assert "data.domain_weights" in msg and "'code'" in msg and "['ifeval', 'math']" in msg
    # a file source names its domains only in its rows: checked when the dataset is built (tests/tasks/stages/test_prepare.py)
    load_config(write(tmp_path, "data:\n  sources:\n    - {kind: file, uri: /x.jsonl}\n  domain_weights: {code: 1.0}\n"))


def test_a_train_split_below_one_batch_is_refused_naming_both_numbers(tmp_path):
    """Was: a batch drew a prompt twice and its groups merged (one group_id)."""
    msg = config_error(tmp_path, "data:\n  train_size: 48\nrollout:\n  prompts_per_iteration: 64\n")
    assert "data.train_size=48" in msg and "rollout.prompts_per_iteration=64" in msg
    msg = config_error(tmp_path, "data:\n  train_size: 8\n  sources:\n    - {kind: ifeval}\n    - {kind: ifeval, train_size: 4}\n"
                                 "rollout:\n  prompts_per_iteration: 16\n")
    assert "12 prompts" in msg and "rollout.prompts_per_iteration=16" in msg
    load_config(write(tmp_path, "data:\n  train_size: 64\nrollout:\n  prompts_per_iteration: 64\n"))


def test_prompt_bound_fields(tmp_path):
    cfg = load_config(write(tmp_path, "data:\n  max_prompt_tokens: 512\n  over_length: truncate\n"))
    assert (cfg.data.max_prompt_tokens, cfg.data.over_length) == (512, "truncate")
    assert FlyrollConfig().data.max_prompt_tokens is None and FlyrollConfig().data.over_length == "drop"
    assert "data.over_length" in config_error(tmp_path, "data:\n  over_length: cut\n")
