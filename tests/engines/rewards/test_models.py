"""Model rewards routed from config (`reward.functions: {domain: judge | reward_model}`): a tiny
sequence-classification reward model and a tiny trained judge, built here, scored through the real
reward workers (real Ray) and through `ModelRewards` directly; the model is built once per worker
and scores in batches; failures cost only their samples and are flagged."""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import random
from pathlib import Path

import pandas as pd
import pytest

from configs.schema import ConfigError, parse_config
from tasks.run.types import RunSpec

REPO = Path(__file__).resolve().parents[3]
RUBRIC = "q:{prompt} a:{response}\nscore:"     # the char tokenizer has no upper case and no brackets


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> str:
    import torch

    from engines.rewards.reward_model import build_tiny_reward_model

    torch.set_num_threads(1)
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm")), max_positions=128)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> str:
    """A tiny char-level Qwen2 judge taught (200 SFT steps, ~2 s) to answer '8' to the response 'good'
    and 'x' (no score: a judge failure) to 'bad', for any arithmetic question."""
    import torch

    from engines.models.modeling import build_tiny_policy, save_policy
    from engines.training.pretrain import supervised_finetune

    torch.set_num_threads(1)
    model, tok = build_tiny_policy(hidden_size=32, num_layers=2, num_heads=2, max_positions=128, seed=0)
    rng = random.Random(0)
    pairs = []
    for _ in range(200):
        q = f"{rng.randrange(10)}+{rng.randrange(10)}="
        pairs += [(RUBRIC.format(prompt=q, response="good"), "8"), (RUBRIC.format(prompt=q, response="bad"), "x")]
    supervised_finetune(model, tok, pairs, steps=200, batch_size=16, lr=1e-2, seed=0)
    return save_policy(model, tok, str(tmp_path_factory.mktemp("judge")))


def _options(section: str, **overrides):
    """The config's reward.<section> (JudgeConfig / RewardModelConfig) with `overrides`."""
    return getattr(parse_config({}).reward, section).model_copy(update=overrides)


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["judge", "reward_model"])
def test_routing_to_a_model_reward_without_its_model_is_refused(name):
    with pytest.raises(ConfigError, match=rf"reward\.{name}\.model: domain\(s\) \['qa'\] route to '{name}'"):
        parse_config({"reward": {"functions": {"qa": name, "arithmetic": "exact_match"}}})
    with pytest.raises(ConfigError, match=rf"reward\.{name}\.model: domain\(s\) \['{name}'\]"):   # a source labelled so
        parse_config({"data": {"sources": [{"kind": "file", "uri": "x.jsonl", "domain": name}]}})
    cfg = parse_config({"reward": {"functions": {"qa": name}, name: {"model": "s3://bucket/m"}}})
    assert getattr(cfg.reward, name).model == "s3://bucket/m"


def test_bad_judge_rubric_and_reward_model_scale_are_refused():
    with pytest.raises(ConfigError, match=r"reward\.judge\.rubric: has no \{response\}"):
        parse_config({"reward": {"judge": {"rubric": "rate {prompt}"}}})
    with pytest.raises(ConfigError, match=r"reward\.judge\.rubric: not a usable str\.format template \(KeyError: 'answer'\)"):
        parse_config({"reward": {"judge": {"rubric": "{answer} {response}"}}})
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.scale: 0 with normalize='affine'"):
        parse_config({"reward": {"reward_model": {"normalize": "affine", "scale": 0}}})
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.batch_size"):
        parse_config({"reward": {"reward_model": {"batch_size": 0}}})


# --- ModelRewards, in process -------------------------------------------------------------------

PROMPTS = ["1+1=", "rev abc=", "what is 2*3?", "x", "9-3=", "7*7=", "2+2="]
RESPONSES = ["2", "cba", "6 because 2*3 is 6", "", "6", "49", "5"]


def test_reward_model_is_built_once_and_scores_in_batches(rm_dir):
    from engines.rewards.models import ModelRewards
    from engines.rewards.reward_model import RewardModelScorer

    direct = RewardModelScorer(rm_dir, batch_size=1).score_batch(PROMPTS, RESPONSES)
    with cf.ThreadPoolExecutor(4) as pool:
        rewards = ModelRewards(pool)
        samples = [{"prompt": p} for p in PROMPTS]
        first, hung = rewards.score("reward_model", _options("reward_model", model=rm_dir, batch_size=3), RESPONSES, samples)
        again, _ = rewards.score("reward_model", _options("reward_model", model=rm_dir, batch_size=3), RESPONSES, samples)
    assert not hung and all(e is None for _, e in first)
    assert [s for s, _ in first] == pytest.approx(direct, abs=1e-5)            # batching and padding change nothing
    assert again == first                                                       # deterministic
    assert rewards.stats["reward_model"] == {"builds": 1, "calls": 2 * math.ceil(7 / 3), "samples": 14}


def test_model_reward_failures_cost_only_their_samples(rm_dir, tmp_path):
    from engines.rewards.models import ModelRewards

    with cf.ThreadPoolExecutor(4) as pool:
        rewards = ModelRewards(pool)
        opts = _options("reward_model", model=rm_dir, batch_size=4, normalize="sigmoid")
        samples = [{"prompt": p} for p in PROMPTS]
        samples[1] = {"prompt": None}                                           # this sample raises on its own
        out, hung = rewards.score("reward_model", opts, RESPONSES, samples)
        assert not hung
        assert out[1][0] == 0.0 and out[1][1].startswith("TypeError")
        assert all(0 < s < 1 and e is None for i, (s, e) in enumerate(out) if i != 1)   # its batch-mates re-scored
        timed, hung = rewards.score("reward_model", opts.model_copy(update={"timeout_s": 1e-9}), RESPONSES[:3], samples[:1] * 3)
        assert hung and all(s == 0.0 and "timeout after 1e-09s" in e for s, e in timed)
        missing, _ = rewards.score("judge", _options("judge"), ["a"], [{"prompt": "p"}])
        assert missing == [(0.0, "reward.judge.model is not set, but this sample's domain routes to 'judge'")]
        gone, _ = rewards.score("judge", _options("judge", model=str(tmp_path / "nowhere")), ["a", "b"], [{"prompt": "p"}] * 2)
        assert all(s == 0.0 and "could not be loaded: FileNotFoundError" in e and "nowhere" in e for s, e in gone)


# --- through the reward workers, in real Ray ------------------------------------------------------

@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield
    ray.shutdown()


def test_score_task_routes_domains_to_the_reward_model_and_the_judge(ray_local, rm_dir, judge_dir, tmp_path):
    """The score task's own function: rewards, reward_error and reward/errors for a table mixing a
    reward-model domain, a judge domain and a rule-based one, in one reward worker."""
    import ray

    from engines.rewards.reward_model import RewardModelScorer
    from infra import tracking
    from tasks.stages.scoring import score

    cfg = parse_config({"reward": {
        "functions": {"chat": "reward_model", "qa": "judge"}, "num_workers": 1,
        "reward_model": {"model": rm_dir, "batch_size": 3, "normalize": "sigmoid"},
        "judge": {"model": judge_dir, "rubric": RUBRIC, "max_new_tokens": 3, "batch_size": 4}}})
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = tracking.start_parent_run(uri, "model-rewards", "t", {}, {})
    spec = RunSpec(cfg.to_json(), cfg.hash(), f"mr{os.getpid()}", str(tmp_path / "store"), uri, parent)
    qa = ["good", "bad", "good", "good", "bad", "good"]
    rows = ([("chat", p, r, None) for p, r in zip(PROMPTS, RESPONSES)] + [("qa", f"{i}+{i}=", r, None) for i, r in enumerate(qa)]
            + [("arithmetic", "3+4=", "7", "7")])
    df = pd.DataFrame([{"prompt_id": f"train-{i}", "group_id": f"1:{i // 2}", "sample_id": i % 2, "domain": d, "prompt": p,
                        "answer": a, "prompt_token_ids": [1], "response": r, "response_token_ids": [1, 2],
                        "behaviour_logprobs": [0.0, 0.0], "finish_reason": "stop", "policy_version": 0}
                       for i, (d, p, r, a) in enumerate(rows)])
    out = score.task_function(spec=spec, batch=df, iteration=1)
    again = score.task_function(spec=spec, batch=df, iteration=1)
    assert again["reward"].tolist() == out["reward"].tolist()                   # deterministic

    chat, judged = out[out["domain"] == "chat"], out[out["domain"] == "qa"]
    expected = RewardModelScorer(rm_dir, normalize="sigmoid").score_batch(PROMPTS, RESPONSES)
    assert chat["reward"].tolist() == pytest.approx(expected, abs=1e-5) and chat["reward_error"].isna().all()
    assert judged["reward"].tolist() == [0.8 if r == "good" else 0.0 for r in qa]
    assert judged["reward_error"].tolist() == [None if r == "good" else "judge output has no score: 'x'" for r in qa]
    assert out["reward"].iloc[-1] == 1.0 and out["reward_error"].iloc[-1] is None

    worker = ray.get_actor(f"flyroll/{spec.run_id}/reward/0", namespace="flyroll")
    stats = ray.get(worker.model_stats.remote())                                # one load per actor, batched calls
    assert stats["reward_model"] == {"builds": 1, "calls": 2 * math.ceil(7 / 3), "samples": 14}
    assert stats["judge"] == {"builds": 1, "calls": 2 * math.ceil(6 / 4), "samples": 12}
    metrics = tracking.client(uri).get_run(parent).data.metrics
    assert metrics["reward/errors"] == 2.0 and metrics["reward/qa/errors"] == 2.0 and metrics["reward/chat/errors"] == 0.0
    assert metrics["reward/qa/mean"] == pytest.approx(0.8 * 4 / 6)
