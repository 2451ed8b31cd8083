"""reasoning-gym prompts a small model can follow (few-shot, per-generator settings, a held-out split
with no train overlap) and the evaluation that measures them (stop strings, sampled pass@k, per
generator)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from pydantic import ValidationError

from configs.schema import SourceConfig
from engines.data import sources
from engines.rewards.reasoning_gym import reasoning_gym_reward
from engines.rewards.evaluation import eval_metrics, generate_responses, sampled_metrics, task_of

EASY_SUM = {"min_terms": 2, "max_terms": 2, "max_digits": 1}


def _splits(**src):
    from tasks.run.splits import source_splits

    full = SourceConfig(kind="reasoning_gym", **src).model_dump()
    return source_splits(full, {"train_size": 40, "eval_size": 12, "domains": ()}, seed=3)


def test_fewshot_prompts_share_their_examples_and_never_ask_them():
    train, evals, problems = _splits(names=("chain_sum", "leg_counting"), settings={"chain_sum": EASY_SUM}, shots=2)
    assert not problems and len(train) == 40 and len(evals) == 12
    asked = {m["rg_entry"]["question"] for df in (train, evals) for m in df["metadata"]}
    for name in ("chain_sum", "leg_counting"):
        prompts = [p for df in (train, evals) for p, m in zip(df["prompt"], df["metadata"]) if m["rg_dataset"] == name]
        prefixes = {p[: p.rindex("Question:")] for p in prompts}
        assert len(prefixes) == 1, f"{name}: train and eval prompts must show the same examples"
        (prefix,) = prefixes
        shown = re.findall(r"Question: (.*?)\nAnswer: (.*?)\n\n", prefix, flags=re.S)
        assert len(shown) == 2 and all(a.strip() for _, a in shown)
        assert not {q for q, _ in shown} & asked, "an example question is also asked"
        assert all(p.endswith("\nAnswer:") for p in prompts)
    assert not set(train["prompt"]) & set(evals["prompt"]), "an eval prompt is in the train split"


def test_settings_reach_the_generator_and_the_scorer():
    train, _, _ = _splits(names=("chain_sum",), settings={"chain_sum": EASY_SUM})
    for m in train["metadata"]:
        numbers = re.findall(r"\d+", m["rg_entry"]["question"])
        assert len(numbers) == 2 and all(len(x) == 1 for x in numbers), m["rg_entry"]["question"]
        assert {k: m["rg_config"][k] for k in EASY_SUM} == EASY_SUM
    row = train.iloc[0].to_dict()
    assert reasoning_gym_reward(f" {row['answer']}\n", row) == 1.0  # the few-shot response form
    assert row["prompt"].endswith(sources.RG_INSTRUCTION)  # no shots: the tag instruction


def test_a_held_out_split_too_large_for_the_task_space_is_refused():
    tiny_space = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_negation": False}
    with pytest.raises(ValueError, match="chain_sum.*task space is too small"):
        sources.reasoning_gym_source(["chain_sum"], 50, 1, config={"chain_sum": tiny_space},
                                     exclude={f"State the final answer to the following arithmetic problem: {a} {op} {b} ="
                                              for a in range(10) for b in range(10) for op in "+-"})


@pytest.mark.parametrize("src, match", [
    (dict(kind="reasoning_gym", names=("chain_sum",), settings={"leg_counting": {}}), r"settings for \['leg_counting'\]"),
    (dict(kind="ifeval", shots=2), "apply to kinds 'reasoning_gym' and 'file' only"),
    (dict(kind="file", uri="p.jsonl", settings={"x": {}}), "settings apply to kind 'reasoning_gym' only"),
])
def test_source_settings_are_checked(src, match):
    with pytest.raises(ValidationError, match=match):
        SourceConfig(**src)


def test_a_file_source_takes_shots_and_an_instruction():
    src = SourceConfig(kind="file", uri="p.csv", domain="math", shots=3, instruction="Answer with a number.")
    assert (src.shots, src.instruction) == (3, "Answer with a number.")


def test_a_generator_refusing_its_settings_is_named():
    with pytest.raises(ValueError, match=r"generator 'chain_sum' refuses the settings \{'bogus': 1\}"):
        sources.reasoning_gym_source(["chain_sum"], 4, 1, config={"chain_sum": {"bogus": 1}})


def _scored(rewards: list[float], tasks: list[str], k: int) -> pd.DataFrame:
    n = len(rewards) // k
    return pd.DataFrame({"eval_index": [i // k for i in range(n * k)], "domain": "math", "reward": rewards,
                         "response_length": 1, "metadata": [json.dumps({"rg_dataset": t}) for t in tasks]})


def test_sampled_metrics_count_prompts_with_a_right_sample():
    # prompt 0 (chain_sum): 1 of 3 right; prompt 1 (chain_sum): none; prompt 2 (gcd): 3 of 3
    df = _scored([0, 1, 0, 0, 0, 0.5, 1, 1, 1], ["chain_sum"] * 6 + ["gcd"] * 3, k=3)
    m = sampled_metrics(df, 3)
    assert m["pass_at_3"] == pytest.approx(2 / 3) and m["sampled_accuracy"] == pytest.approx(4 / 9)
    assert m["pass_at_3/math/chain_sum"] == pytest.approx(0.5) and m["pass_at_3/math/gcd"] == 1.0
    assert m["sampled_accuracy/math/chain_sum"] == pytest.approx(1 / 6)


def test_greedy_metrics_break_down_per_generator():
    df = _scored([1, 0, 0, 1], ["chain_sum", "chain_sum", "gcd", "gcd"], k=1)
    df.loc[3, "metadata"] = "not json"  # a row that names no generator counts overall and per domain only
    m = eval_metrics(df)
    assert m["accuracy"] == 0.5 and m["accuracy/math"] == 0.5
    assert m["accuracy/math/chain_sum"] == 0.5 and m["accuracy/math/gcd"] == 0.0
    assert task_of({"rg_dataset": "gcd"}) == "gcd" and task_of(None) is None


def test_eval_generation_stops_at_the_rollout_stop_strings_and_samples_reproducibly(tiny_policy):
    from engines.generation.engine import HFGenerationEngine
    from engines.models.modeling import CHARSET

    model, tok = tiny_policy
    engine = HFGenerationEngine(model, tok)
    table = pd.DataFrame({"prompt": ["12+3=", "7*8=", "abc"], "domain": "math", "answer": ["15", "56", "cba"]})
    free = generate_responses(engine, tok, table, max_new_tokens=8)
    stopped = generate_responses(engine, tok, table, max_new_tokens=8, stop=tuple(CHARSET))  # any character ends it
    assert free["response_length"].max() > 1 and stopped["response_length"].max() == 1
    a = generate_responses(engine, tok, table, max_new_tokens=8, samples=3, temperature=1.0, seed=5)
    b = generate_responses(engine, tok, table, max_new_tokens=8, samples=3, temperature=1.0, seed=5)
    assert list(a["eval_index"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2] and list(a["sample_index"]) == [0, 1, 2] * 3
    assert list(a["response"]) == list(b["response"]), "the same seed must give every checkpoint the same draws"
    assert a["response"].nunique() > 3


def test_other_source_kinds_survive_the_config_round_trip_between_tasks():
    from configs.schema import FlyrollConfig, parse_config

    cfg = parse_config({"data": {"sources": [{"kind": "humaneval"}, {"kind": "reasoning_gym", "names": ["gcd"], "shots": 2}]}})
    again = FlyrollConfig.model_validate_json(cfg.to_json())  # how tasks pass the config on (every default written out)
    assert again.data.sources[1].shots == 2 and again.data.sources[0].shots == 0


def test_eval_metric_names_are_accepted_by_mlflow(tmp_path):
    # the evaluation task logs these as eval/<name>: MLflow refuses names with characters such as "@"
    from infra import tracking

    df = _scored([0, 1, 0, 0, 0, 0.5, 1, 1, 1], ["chain_sum"] * 6 + ["gcd"] * 3, k=3)
    metrics = {f"eval/{k}": v for k, v in {**eval_metrics(df), **sampled_metrics(df, 3)}.items()}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.start_parent_run(uri, "names", "names", params={}, tags={})
    tracking.log_metrics(uri, run_id, metrics, step=0)
    logged = tracking.client(uri).get_run(run_id).data.metrics
    assert logged["eval/pass_at_3/math/chain_sum"] == pytest.approx(0.5) and set(metrics) <= set(logged)
