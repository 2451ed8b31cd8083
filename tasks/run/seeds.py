"""Every random stream of a run, named, derived from `run.seed` in one place.

Each stream is a function of the run's seed and the position in the run (iteration, round, call):
two streams never share draws, and a rerun draws the same numbers. The multipliers are distinct
primes, so (run seed, iteration) pairs of one stream do not collide with another's for any
realistic run length. Changing a value here changes every run's draws: the presets' measured
curves (docs/learning.md) were taken with these.

The engines keep their own named strides (engines/generation/router.py `SEED_STRIDE` between the
calls of one router, engines/data/synthetic.py's split seeds, engines/data/sources.py `SHOT_SEED`):
they are below this floor and are handed the seeds made here.
"""

from __future__ import annotations

RUN_STRIDE = 1_000_003    # one run seed's prompt streams apart from the next one's
SAMPLING_STRIDE = 100_003  # the same for the rollout's sampling seeds
ROUND_STRIDE = 7_919       # a refill round's (or a partial rollout segment's) draws apart from the last
CHUNK_STRIDE = 50_021      # one scheduler chunk's sampling seed apart from the last
EVAL_SAMPLING_OFFSET = 7_777_777  # evaluation samples (eval.samples > 1) never share draws with a rollout

# environment seeds (agentic runs): bootstrap demonstrations, the fixed eval set and training never overlap
BOOTSTRAP_ENV_SEED0, EVAL_ENV_SEED0, TRAIN_ENV_SEED0 = 20_000_000, 10_000_000, 0
RESERVED_ENV_SEEDS = 1_000_000  # the eval and bootstrap ranges' size (env.eval_episodes, env.bootstrap_episodes at most)


def rollout_seed(run_seed: int, iteration: int) -> int:
    """The rollout's sampling seed at `iteration` (RLVR and agentic; partial rollout offsets it per segment)."""
    return run_seed * SAMPLING_STRIDE + iteration


def prompt_mix_seed(run_seed: int, iteration: int, round_: int = 0) -> int:
    """The per-domain prompt draw (`data.domain_weights`) of `iteration`; refill round `round_` draws anew."""
    return run_seed * RUN_STRIDE + iteration + ROUND_STRIDE * round_


def refill_stream_seed(run_seed: int, round_: int) -> int:
    """The prompt stream a refill round `round_` slices (round 0 is the rollout's own stream)."""
    return run_seed + ROUND_STRIDE * round_


def epoch_order_seed(stream_seed: int, epoch: int) -> int:
    """The permutation of the train split in epoch `epoch` of a prompt stream."""
    return stream_seed * RUN_STRIDE + epoch


def segment_seed(rollout: int, round_: int, *, continued: bool = False, max_new_tokens: int = 0) -> int:
    """Partial rollout: round `round_`'s new groups, or (continued) its carried samples' continuation."""
    if continued:
        return rollout + ROUND_STRIDE * (2 * round_ + 1) + 101 * max_new_tokens
    return rollout + ROUND_STRIDE * 2 * round_


def chunk_seed(rollout: int, chunk: int) -> int:
    """The sampling seed of the scheduler's `chunk`-th chunk (dynamic sampling) of one rollout."""
    return rollout + CHUNK_STRIDE * chunk


def update_seed(run_seed: int, iteration: int) -> int:
    """The update's own draws at `iteration` (mini-batch shuffles); replay repeats it."""
    return run_seed * ROUND_STRIDE + iteration


def eval_sampling_seed(run_seed: int) -> int:
    """Evaluation's sampled responses (eval.samples > 1)."""
    return run_seed + EVAL_SAMPLING_OFFSET


def eval_split_seed(source_seed: int) -> int:
    """A generated source's eval split, apart from its train split (reasoning-gym, IFEval)."""
    return source_seed + RUN_STRIDE


def train_env_seed0(run_seed: int, iteration: int, per_iteration: int) -> int:
    """The first environment seed of an agentic iteration's block of `per_iteration` disjoint seeds."""
    return TRAIN_ENV_SEED0 + run_seed * RUN_STRIDE + (iteration - 1) * per_iteration


def train_env_seeds(run_seed: int, iteration: int, per_iteration: int) -> list[int]:
    """The environment seeds an agentic iteration may play: its block from `train_env_seed0`, with any
    seed that falls in the held-out evaluation or the bootstrap range moved past that range. Run seeds
    10 and 20 start inside them (10 * 1_000_003 = 10_000_030): without the move such a run trained on
    the very seeds its evaluation calls held out. Other run seeds' blocks are unchanged."""
    base = train_env_seed0(run_seed, iteration, per_iteration)
    return [_past_reserved(base + i) for i in range(per_iteration)]


def _past_reserved(seed: int) -> int:
    for start in (EVAL_ENV_SEED0, BOOTSTRAP_ENV_SEED0):
        if start <= seed < start + RESERVED_ENV_SEEDS:
            return seed + RESERVED_ENV_SEEDS
    return seed
