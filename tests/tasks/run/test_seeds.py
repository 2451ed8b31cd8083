"""tasks/run/seeds.py: each named stream gives the value the run's draws were measured with (hand-worked
below; changing one changes every preset's curve), and the streams of one run do not collide."""

from __future__ import annotations

from tasks.run import seeds


def test_each_stream_keeps_its_value():
    # run seed 3, iteration 2 (round 1, chunk 4, budget 16 where they apply)
    assert seeds.rollout_seed(3, 2) == 3 * 100_003 + 2 == 300_011
    assert seeds.prompt_mix_seed(3, 2) == 3 * 1_000_003 + 2 == 3_000_011
    assert seeds.prompt_mix_seed(3, 2, round_=1) == 3_000_011 + 7_919
    assert seeds.refill_stream_seed(3, 1) == 3 + 7_919
    assert seeds.epoch_order_seed(3, 2) == 3 * 1_000_003 + 2
    assert seeds.segment_seed(300_011, 1) == 300_011 + 2 * 7_919
    assert seeds.segment_seed(300_011, 1, continued=True, max_new_tokens=16) == 300_011 + 3 * 7_919 + 101 * 16
    assert seeds.chunk_seed(300_011, 4) == 300_011 + 4 * 50_021
    assert seeds.update_seed(3, 2) == 3 * 7_919 + 2
    assert seeds.eval_sampling_seed(3) == 3 + 7_777_777
    assert seeds.eval_split_seed(5) == 5 + 1_000_003
    assert seeds.train_env_seed0(3, 2, 8) == 3 * 1_000_003 + 8


def test_environment_seed_blocks_never_overlap():
    """Training, evaluation and bootstrap environment seeds of realistic runs stay in separate ranges, and
    an agentic run's iterations take disjoint blocks."""
    evals = set(range(seeds.EVAL_ENV_SEED0, seeds.EVAL_ENV_SEED0 + 512))
    boot = set(range(seeds.BOOTSTRAP_ENV_SEED0, seeds.BOOTSTRAP_ENV_SEED0 + 4096))
    train = {seeds.train_env_seed0(0, it, 64) + i for it in range(1, 101) for i in range(64)}
    assert len(train) == 100 * 64 and not (train & evals) and not (train & boot) and not (evals & boot)


def test_a_run_draws_different_numbers_per_iteration_and_stream():
    rollouts = {seeds.rollout_seed(0, it) for it in range(1, 1001)}
    mixes = {seeds.prompt_mix_seed(0, it) for it in range(1, 1001)}
    assert len(rollouts) == len(mixes) == 1000
    assert seeds.rollout_seed(1, 1) != seeds.rollout_seed(0, 1) and seeds.update_seed(1, 1) != seeds.update_seed(0, 1)


def test_no_run_seed_trains_on_a_held_out_or_bootstrap_seed():
    """Run seeds 10 and 20 start their training blocks inside the held-out evaluation range
    (10 * 1_000_003 = 10_000_030) and the bootstrap range: those seeds move past the range. The blocks
    of run seeds 0-9 (every measured preset's) keep their values."""
    held_out = set(range(seeds.EVAL_ENV_SEED0, seeds.EVAL_ENV_SEED0 + seeds.RESERVED_ENV_SEEDS))
    bootstrap = set(range(seeds.BOOTSTRAP_ENV_SEED0, seeds.BOOTSTRAP_ENV_SEED0 + seeds.RESERVED_ENV_SEEDS))
    for run_seed in (10, 20):
        old = {seeds.train_env_seed0(run_seed, it, 64) + i for it in range(1, 51) for i in range(64)}
        assert old & (held_out | bootstrap)                                    # the collision this guards against
        new = [s for it in range(1, 51) for s in seeds.train_env_seeds(run_seed, it, 64)]
        assert len(set(new)) == len(new) == 50 * 64 and not set(new) & (held_out | bootstrap)
    for run_seed in range(10):
        assert seeds.train_env_seeds(run_seed, 3, 8) == [seeds.train_env_seed0(run_seed, 3, 8) + i for i in range(8)]
