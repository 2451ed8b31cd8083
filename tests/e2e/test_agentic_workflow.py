"""workflows/agentic.py through the real `pyflyte run`: episodes -> returns -> reference -> training
(loss on the policy's tokens only) -> weight sync; held-out success metrics in MLflow."""

from __future__ import annotations

import pytest

from tests.support.agentic import _history, _run


@pytest.mark.slow
def test_agentic_workflow_end_to_end(tmp_path):
    """A Ray cluster per task (the path a Flyte cluster runs), the environments in a Ray env worker pool
    (env.workers: each stage's cluster gets its `<stage>-env-workers` pod), and dynamic sampling
    (algorithm.filter_groups): groups with all-equal returns are refilled from further seeds, with one group
    more in flight than still needed (env.extra_groups), the surplus cancelled and counted. Evaluated at 0
    and at the end (2), not after every iteration: one cluster fewer."""
    import pandas as pd

    from infra.store import ArtifactStore

    c, run, _ = _run(tmp_path, "tests/configs/agentic_e2e.yaml", ray_mode="per-task", loop={"eval_every": 2},
                     env={"workers": 2, "worker_cpus": 0.5, "extra_groups": 1},
                     algorithm={"filter_groups": True, "max_generation_rounds": 3})
    assert _history(c, run, "timing/rollout_ray_start_s") and _history(c, run, "timing/evaluation_ray_start_s")
    for key in ("env/success_rate", "env/effective_action_rate", "env/invalid_action_rate", "env/turns",
                "eval/success_rate", "eval/effective_action_rate", "actor/pg_loss"):
        assert _history(c, run, key), key
    values = lambda key: [v for _, v in _history(c, run, key)]  # noqa: E731
    assert values("env_workers/actors") == [2.0, 2.0] and values("env_manager/staleness_max") == [0.0, 0.0]
    # iteration 1 samples from the reference itself: KL over the policy's tokens ~0 (counting the
    # environment's tokens, which have no behaviour log-prob, gave 0.33-0.70 in SmolLM2 runs)
    assert 0.0 <= values("reference/kl_k3")[0] < 1e-4, values("reference/kl_k3")
    rows = list(zip(values("env_manager/filter_fallback"), values("reward/groups_all_equal_frac"),
                    values("env_manager/groups_kept"), values("env_manager/groups_launched"),
                    values("env_manager/groups_filtered"), values("env_manager/groups_aborted"),
                    values("env_manager/groups_dropped")))
    assert len(rows) == 2, rows
    for fallback, all_equal, kept, launched, filtered, aborted, dropped in rows:
        assert 3 <= launched <= 6                                    # B = 2 + 1 spare at a time, B x rounds seeds
        assert (0 if fallback else kept) + filtered + aborted + dropped == launched, rows
        if fallback:                                                 # none passed: the first B rejected, unfiltered
            assert (kept, launched, filtered) == (2, 6, 6)
        else:                                                        # kept groups carry signal; fewer only when spent
            assert all_equal == 0.0 and (kept == 2 or launched == 6) and kept >= 1

    # the held-out transcripts: each episode once, headed by its seed and outcome, its prompt not repeated
    text = open(c.download_artifacts(run.info.run_id, "eval/transcripts_v0000.txt", str(tmp_path))).read()
    episodes = text.split("\n\n# seed ")
    assert text.startswith("# seed ") and len(episodes) == 4        # env.eval_episodes of tests/configs/agentic_e2e.yaml
    for episode in episodes:
        head, prompt_line = episode.splitlines()[:2]
        assert ", return " in head and " turns, " in head, head    # seed, group, sample: outcome, return, turns, finish
        assert episode[:episode.index("[turn 1] policy:")].count(prompt_line) == 1   # the prompt once

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


@pytest.mark.slow
def test_agentic_off_policy_episodes_lag_one_version_and_are_corrected(tmp_path):
    """pipeline.off_policy_steps: 1 in the agentic workflow (the environments in an env worker pool,
    the asynchronous manager): iteration i's episodes are played by v(i-2) while the update starts
    from v(i-1). Every row names the version that played it, the lag is logged, the truncated
    importance weights differ from 1 exactly where the player lagged, and each rollout table's
    lineage names the player first and the policy it trained as `trained_from`."""
    from pathlib import Path

    import pandas as pd
    from safetensors.torch import load_file

    from infra.store import ArtifactStore
    from tests.support.sync import digests

    c, run, _ = _run(tmp_path, "tests/configs/agentic_e2e.yaml", loop={"iterations": 3, "eval_every": 3},
                     pipeline={"off_policy_steps": 1}, algorithm={"tis_cap": 2.0}, rollout={"prompts_per_iteration": 4},
                     env={"workers": 1, "worker_cpus": 0.5, "bootstrap_episodes": 60},
                     # a policy that writes some valid moves: mixed returns, so most updates are not zero
                     model={"bootstrap": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "steps": 120,
                                          "max_positions": 512}})
    store = ArtifactStore(str(tmp_path / "runs" / "store"))
    keys = sorted(k for k in store.list("runs") if "/rollouts/" in k)
    versions = [sorted(set(pd.read_parquet(f"{store.fetch(k, str(tmp_path / 'r' / k))}/rollout.parquet")["policy_version"]))
                for k in keys]
    assert versions == [[0], [0], [1]], versions
    assert _history(c, run, "rollout/staleness") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert [v for _, v in _history(c, run, "env_manager/staleness_max")] == [0.0, 0.0, 0.0]  # one version per rollout
    policies = sorted(k for k in store.list("runs") if "/policy/" in k)
    second, third = store.manifest(keys[1]), store.manifest(keys[2])
    assert second.parents[0].startswith("models/") and second.metadata["trained_from"] == policies[0]  # played by v0, trained v1
    assert third.parents[0] == policies[0] and third.parents[-1] == policies[1]

    def weights(key):  # name -> digest of every tensor of a published policy
        folder = Path(store.fetch(key, str(tmp_path / "w" / key)))
        return digests({k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()})

    # the update's π_old (the trainer's v(i-1)) departs from the player's log-probs exactly where the
    # player's weights differ from the trainer's: at iteration 1 never (engine-vs-trainer rounding
    # only); at 2 and 3 unless the previous update left the weights unchanged (a batch of all-equal
    # groups). Read as the largest |π_old - behaviour| over the loss's tokens: the mean TIS weight is
    # no such test, since E_behaviour[π_old / π_behaviour] = 1 keeps it near 1 however far apart the
    # two are (it was 1.00007 at a lagged iteration under CI load).
    tis = dict(_history(c, run, "actor/tis_weight_mean"))
    assert sorted(tis) == [1, 2, 3] and abs(tis[1] - 1.0) < 1e-3, tis
    gap = dict(_history(c, run, "reference/behaviour_logprob_diff"))
    lagged = {i: weights(store.manifest(keys[i - 1]).parents[0]) != weights(policies[i - 2]) for i in (2, 3)}
    assert any(lagged.values()), "no update changed the weights: nothing lagged"
    assert gap[1] < 1e-3, gap
    for i, differ in lagged.items():
        assert (gap[i] > 10 * gap[1] + 1e-3) == differ, (i, gap, lagged)


@pytest.mark.parametrize("overrides,seeds,spare", [
    ([], [[0, 1], [2, 3]], 0),                                               # exactly B groups
    (["env.workers=1", "env.extra_groups=2"], [[0, 1, 2, 3], [4, 5, 6, 7]], 2),   # B + k, k spare
    (["env.workers=1", "algorithm.filter_groups=true", "algorithm.max_generation_rounds=3"],
     [list(range(6)), list(range(6, 12))], 0),                              # B x rounds, refills
    (["env.workers=1", "algorithm.filter_groups=true", "algorithm.max_generation_rounds=3", "env.extra_groups=1"],
     [list(range(6)), list(range(6, 12))], 1),
])
def test_rollout_seeds_take_disjoint_blocks_sized_by_filtering_and_extra_groups(overrides, seeds, spare):
    from configs.schema import load_config
    from tasks.stages.agentic import rollout_seeds
    from tasks.run.seeds import TRAIN_ENV_SEED0
    from tests.support.workflow import REPO

    cfg = load_config(REPO / "tests/configs/agentic_e2e.yaml", overrides)   # B = 2
    got = [rollout_seeds(cfg, i) for i in (1, 2)]
    assert [s for s, _ in got] == [[TRAIN_ENV_SEED0 + x for x in block] for block in seeds]
    assert {k for _, k in got} == {spare}
    seed1 = rollout_seeds(load_config(REPO / "tests/configs/agentic_e2e.yaml", [*overrides, "run.seed=1"]), 1)[0]
    assert not set(seed1) & {x for s, _ in got for x in s}                  # another run.seed, other seeds


def test_gigpo_runs_on_agentic_rows(tiny_policy):
    """The training path computes GiGPO advantages from the rollout table's per-turn columns; the
    advantage is zero on environment tokens."""
    import json

    import pandas as pd
    import torch

    from engines.algorithms.config import AlgorithmConfig
    from engines.agentic.env_manager import run_episodes
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.training.rl_step import prepare_update
    from engines.data.rollout_table import batch_from_table

    model, tok = tiny_policy
    episodes = run_episodes(HFGenerationEngine(model, tok), tok, "frozenlake", [1, 2], group_size=3, max_turns=3,
                            max_context_tokens=120, sampling=SamplingParams(max_new_tokens=4, stop=("\n",), seed=0),
                            env_kwargs={"size": 3})
    df = pd.DataFrame([{"group_id": ep.group_id, "prompt_token_ids": ep.prompt_token_ids, "response_token_ids": ep.response_token_ids,
                        "loss_mask": ep.loss_mask, "turn_index": ep.turn_index, "turn_rewards": ep.turn_rewards,
                        "state_keys": json.dumps(ep.state_keys), "reward": ep.episode_return, "finish_reason": "done"}
                       for ep in episodes])
    batch = batch_from_table(df, tok.pad_token_id)
    u = prepare_update(batch, AlgorithmConfig(advantage="gigpo", gigpo_step_weight=1.0))
    assert torch.isfinite(u.advantages).all()
    assert (u.advantages[batch.response_mask == 0] == 0).all()
    assert u.advantages.abs().sum() > 0
