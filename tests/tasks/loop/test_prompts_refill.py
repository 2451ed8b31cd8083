"""DAPO dynamic sampling: refill draws (tasks/loop/prompts.py `refill_prompts`) follow `data.domain_weights`, and the
rollout scheduler (engines/generation/scheduler.py) runs in the rollout task over the Ray actors."""

from __future__ import annotations

import pandas as pd

from configs.schema import parse_config
from tests.support.rollout import _parity_rollout_run


def _train() -> pd.DataFrame:
    domains = ["a"] * 100 + ["b"] * 100 + ["c"] * 100
    return pd.DataFrame({"prompt_id": range(300), "domain": domains, "prompt": [f"p{i}" for i in range(300)]})


def test_refills_follow_the_domain_weights():
    from tasks.loop.prompts import refill_prompts

    train = _train()
    cfg = parse_config({})  # weights for the table above; the config check would look for a, b, c in data.sources
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"domain_weights": {"a": 3.0, "b": 1.0, "c": 0.0}})})
    first, second = refill_prompts(cfg, train, 8, 5, 1), refill_prompts(cfg, train, 8, 5, 2)
    for batch in (first, second):          # quotas 3/4 * 8 = 6 and 1/4 * 8 = 2; weight 0 = never
        assert batch["domain"].value_counts().to_dict() == {"a": 6, "b": 2}
        assert (batch["prompt_id"] < 100).sum() == 6 and (batch["prompt_id"] >= 200).sum() == 0
    assert set(first["prompt_id"]) != set(second["prompt_id"])                 # a fresh draw per round
    assert refill_prompts(cfg, train, 8, 5, 1).equals(first)                   # deterministic


def test_refills_without_weights_are_unchanged():
    from tasks.loop.prompts import iteration_prompts
    from tasks.loop.prompts import refill_prompts

    train, cfg = _train(), parse_config({"run": {"seed": 3}})
    assert refill_prompts(cfg, train, 8, 5, 1).equals(iteration_prompts(train, 8, 5, 3 + 7919))
    assert set(refill_prompts(cfg, train, 64, 5, 1)["domain"]) == {"a", "b", "c"}


def test_refills_run_in_the_rollout_task_not_the_scoring_task(tmp_path, monkeypatch, tiny_model_dir):
    """DAPO through the real rollout and score tasks (local Flyte, local Ray, a tiny policy, a reward
    that is always 1 so every group is all-equal and the batch is refilled up to the cap): the
    generation actors the refills need are only ever created by the rollout task, whose cluster is
    declared with room for them (infra/resources.py `hosted_roles`; tests/infra/test_resources_placement.py checks
    the fit); the scoring task creates no generation actor and passes the scored table through."""
    import yaml

    import tasks.actors.hybrid
    import tasks.actors.pools
    import tasks.stages.rollout
    import tasks.stages.scoring
    from infra import tracking
    from infra.ray_session import shutdown
    from tasks.stages.prepare import build_base_policy, make_dataset, prepare_run
    from tests.support.workflow import REPO

    raw = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    raw["run"]["output_dir"] = str(tmp_path / "runs")
    raw["model"] = {"path": tiny_model_dir}
    raw["rollout"].update(prompts_per_iteration=2, samples_per_prompt=2, max_new_tokens=3)
    raw["reward"]["functions"] = {"arithmetic": "tests.support.hostile_rewards:ok", "reverse": "tests.support.hostile_rewards:ok"}
    raw["algorithm"] = {"filter_groups": True, "max_generation_rounds": 2, "kl_coef": 0.0}
    (tmp_path / "dapo.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))

    created, current = [], ["?"]
    for module in (tasks.actors.pools, tasks.actors.hybrid):  # every stage's actor pools (tasks/actors/pools.py; tasks/actors/hybrid.py role_actors)
        def recording(cls, role, *args, _real=module.actor_pool, **kwargs):
            created.append((current[0], role))
            return _real(cls, role, *args, **kwargs)
        monkeypatch.setattr(module, "actor_pool", recording)

    spec, model_spec = prepare_run(config=str(tmp_path / "dapo.yaml"), restart=False)
    base = build_base_policy(model_spec)
    dataset = make_dataset(spec=spec, base=base)
    try:
        current[0] = "rollout"
        batch = tasks.stages.rollout.rollout(spec=spec, policy=base, dataset=dataset, iteration=1)
        current[0] = "scoring"
        scored = tasks.stages.scoring.score(spec=spec, batch=batch, iteration=1)
    finally:
        shutdown()
    assert ("scoring", "generation") not in created, created
    assert {role for task, role in created if task == "rollout"} == {"generation", "reward"}, created
    rounds = tracking.client(spec.tracking_uri).get_metric_history(spec.mlflow_run_id, "dynamic_sampling/generation_rounds")
    assert [m.value for m in rounds] == [2.0]  # the scheduler spent its budget: 2 x prompts_per_iteration prompts
    assert list(scored["reward"]) == list(batch["reward"]) == [1.0] * 4  # nothing informative: the unfiltered batch


def test_the_rollout_scheduler_keeps_exactly_the_batch_through_ray(tmp_path, monkeypatch, tiny_model_dir):
    """DAPO through the real rollout task with a reward that varies within groups (tests/engines/generation/test_scheduler.py
    `parity`): the scheduler over the Ray generation actors and reward workers returns exactly
    prompts_per_iteration groups, each with differing rewards, and logs its metrics."""
    import tasks.stages.rollout
    from infra import tracking
    from infra.ray_session import shutdown

    spec, policy, dataset = _parity_rollout_run(tmp_path, monkeypatch, tiny_model_dir, "dapo", {},
                                                {"filter_groups": True, "max_generation_rounds": 8, "kl_coef": 0.0})
    try:
        batch = tasks.stages.rollout.rollout(spec=spec, policy=policy, dataset=dataset, iteration=1)
    finally:
        shutdown()
    assert batch["group_id"].nunique() == 3 and len(batch) == 6
    assert (batch.groupby("group_id")["reward"].nunique() == 2).all()
    client = tracking.client(spec.tracking_uri)
    for key in ("dynamic_sampling/kept_groups", "dynamic_sampling/generation_rounds", "rollout/aborted_requests",
                "rollout/generated_tokens_per_kept_sample"):
        assert len(client.get_metric_history(spec.mlflow_run_id, key)) == 1, key
    (kept,) = client.get_metric_history(spec.mlflow_run_id, "dynamic_sampling/kept_groups")
    assert kept.value == 3.0


def test_score_while_generating_scores_in_the_rollout_task_chunk_by_chunk(tmp_path, monkeypatch, tiny_model_dir):
    """rollout.score_while_generating through the real rollout task: the batch leaves it scored, all B
    groups (no filter, no refill), generated in chunks of rollout.chunk_prompts with each chunk's
    groups handed to the reward workers before the next chunk is generated; the score task passes
    the table through as it came."""
    import tasks.stages.rollout
    from infra import tracking
    from infra.ray_session import shutdown
    from tasks.stages.scoring import score

    spec, policy, dataset = _parity_rollout_run(tmp_path, monkeypatch, tiny_model_dir, "overlap",
                                                {"score_while_generating": True, "chunk_prompts": 1})
    try:
        batch = tasks.stages.rollout.rollout(spec=spec, policy=policy, dataset=dataset, iteration=1)
        scored = score(spec=spec, batch=batch, iteration=1)
    finally:
        shutdown()
    assert batch["group_id"].nunique() == 3 and len(batch) == 6
    assert {"reward", "reward_error"} <= set(batch.columns) and batch["reward_error"].isna().all()
    assert scored.equals(batch)
    client = tracking.client(spec.tracking_uri)

    def last(key):
        return client.get_metric_history(spec.mlflow_run_id, key)[-1].value

    assert last("rollout/generation_chunks") == 3.0
    assert abs(last("rollout/groups_scored_during_generation") - 2 / 3) < 1e-9
    assert not client.get_metric_history(spec.mlflow_run_id, "dynamic_sampling/kept_groups")  # nothing was filtered
    assert client.get_metric_history(spec.mlflow_run_id, "reward/mean")
