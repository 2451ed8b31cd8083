"""workflows/agentic.py through the real `pyflyte run`: episodes -> returns -> reference -> training
(loss on the policy's tokens only) -> weight sync; held-out success metrics in MLflow."""

from __future__ import annotations

import pytest

from tests.support.agentic import _history, _run


@pytest.mark.slow
def test_agentic_workflow_end_to_end(tmp_path):
    import pandas as pd

    from infra.store import ArtifactStore

    # a Ray cluster per task; evaluated at 0 and at the end (2), not after every iteration: one cluster fewer
    c, run, _ = _run(tmp_path, "tests/configs/agentic_e2e.yaml", ray_mode="per-task", loop={"eval_every": 2})
    assert _history(c, run, "timing/rollout_ray_start_s") and _history(c, run, "timing/evaluation_ray_start_s")
    for key in ("env/success_rate", "env/effective_action_rate", "env/invalid_action_rate", "env/turns",
                "eval/success_rate", "eval/effective_action_rate", "actor/pg_loss"):
        assert _history(c, run, key), key
    store = ArtifactStore(str(tmp_path / "runs" / "store"))
    keys = store.list("runs")
    assert sum("/policy/" in k for k in keys) == 2
    rollout_key = [k for k in keys if k.endswith("rollouts/i0001")][0]
    d = store.fetch(rollout_key, str(tmp_path / "r"))
    df = pd.read_parquet(f"{d}/rollout.parquet")
    assert len(df) == 2 * 3  # seeds x episodes per seed
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
