"""workflows/agentic.py through the real `pyflyte run`: episodes -> returns -> reference -> training
(loss on the policy's tokens only) -> weight sync; held-out success metrics in MLflow."""

from __future__ import annotations

import pytest

from tests.support.agentic import _history, _run


@pytest.mark.slow
def test_agentic_workflow_end_to_end(tmp_path):
    """A Ray cluster per task (the path a Flyte cluster runs), the environments in a Ray env worker pool
    (env.workers: each stage's cluster gets its `<stage>-env-workers` pod), and dynamic sampling
    (algorithm.filter_groups): groups with all-equal returns are refilled from further seeds. Evaluated
    at 0 and at the end (2), not after every iteration: one cluster fewer."""
    import pandas as pd

    from infra.store import ArtifactStore

    c, run, _ = _run(tmp_path, "tests/configs/agentic_e2e.yaml", ray_mode="per-task", loop={"eval_every": 2},
                     env={"workers": 2, "worker_cpus": 0.5},
                     algorithm={"filter_groups": True, "max_generation_rounds": 3})
    assert _history(c, run, "timing/rollout_ray_start_s") and _history(c, run, "timing/evaluation_ray_start_s")
    for key in ("env/success_rate", "env/effective_action_rate", "env/invalid_action_rate", "env/turns",
                "eval/success_rate", "eval/effective_action_rate", "actor/pg_loss"):
        assert _history(c, run, key), key
    values = lambda key: [v for _, v in _history(c, run, key)]  # noqa: E731
    assert values("env_workers/actors") == [2.0, 2.0] and values("env_manager/staleness_max") == [0.0, 0.0]
    rows = list(zip(values("env_manager/filter_fallback"), values("reward/groups_all_equal_frac"),
                    values("env_manager/groups_kept"), values("env_manager/groups_launched"),
                    values("env_manager/groups_filtered")))
    assert len(rows) == 2, rows
    for fallback, all_equal, kept, launched, filtered in rows:
        assert 2 <= launched <= 6                                    # B = 2 at a time, B x max_generation_rounds seeds
        if fallback:                                                 # none passed: the first B rejected, unfiltered
            assert (kept, launched, filtered) == (2, 6, 6)
        else:                                                        # kept groups carry signal; fewer only when spent
            assert all_equal == 0.0 and (kept == 2 or launched == 6) and kept >= 1

    store = ArtifactStore(str(tmp_path / "runs" / "store"))
    keys = store.list("runs")
    assert sum("/policy/" in k for k in keys) == 2
    rollout_key = [k for k in keys if k.endswith("rollouts/i0001")][0]
    d = store.fetch(rollout_key, str(tmp_path / "r"))
    df = pd.read_parquet(f"{d}/rollout.parquet")
    assert len(df) == rows[0][2] * 3  # the kept groups x episodes per seed
    for mask, ids, turns in zip(df["loss_mask"], df["response_token_ids"], df["turn_index"]):
        assert len(mask) == len(ids) == len(turns)
        assert all((m == 1) == (t >= 0) for m, t in zip(mask, turns))  # mask = exactly the policy's tokens


def test_gigpo_runs_on_agentic_rows(tiny_policy):
    """The training path computes GiGPO advantages from the rollout table's per-turn columns; the
    advantage is zero on environment tokens."""
    import json

    import pandas as pd
    import torch

    from engines.algorithms.config import AlgorithmConfig
    from engines.env_manager import run_episodes
    from engines.generation import HFGenerationEngine, SamplingParams
    from engines.rl_step import prepare_update
    from engines.rollout_batch import RolloutBatch

    model, tok = tiny_policy
    episodes = run_episodes(HFGenerationEngine(model, tok), tok, "frozenlake", [1, 2], group_size=3, max_turns=3,
                            max_context_tokens=120, sampling=SamplingParams(max_new_tokens=4, stop=("\n",), seed=0),
                            env_kwargs={"size": 3})
    df = pd.DataFrame([{"group_id": ep.group_id, "prompt_token_ids": ep.prompt_token_ids, "response_token_ids": ep.response_token_ids,
                        "loss_mask": ep.loss_mask, "turn_index": ep.turn_index, "turn_rewards": ep.turn_rewards,
                        "state_keys": json.dumps(ep.state_keys), "reward": ep.episode_return, "finish_reason": "done"}
                       for ep in episodes])
    batch = RolloutBatch.from_table(df, tok.pad_token_id)
    u = prepare_update(batch, AlgorithmConfig(advantage="gigpo", gigpo_step_weight=1.0))
    assert torch.isfinite(u.advantages).all()
    assert (u.advantages[batch.response_mask == 0] == 0).all()
    assert u.advantages.abs().sum() > 0
