"""Model rewards routed from config: a model judge (`judge`) and a reward model (`reward_model`).

A reward function scores one sample per call. These two hold a model instead, so a reward worker
keeps one `ModelRewards`: it builds each model once, lazily, on the first sample routed to it
(`reward.judge` / `reward.reward_model`, engines/rewards/config.py), keeps it, and scores all the samples of a batch
routed to it in chunks of `batch_size`: one judge generate call or one reward-model forward per
chunk, each with its own timeout, in threads of the reward worker (a reward function runs in a
worker process instead, engines/rewards/calls.py). Failures are isolated per chunk:

- a chunk that raises is re-scored one sample per call, so only a sample that raises on its own is
  lost (0.0, "ValueError: ...");
- a chunk that runs past `timeout_s` costs its samples (0.0, "timeout ...") and leaves its thread
  behind: the call reports `hung`, and the caller replaces the worker after its batch;
- a judge output with no parsable score costs its sample (0.0, "judge output has no score: ...");
- a model that cannot be loaded (missing path, load past `load_timeout_s`) flags every sample
  routed to it; the next batch tries to load it again.
"""

from __future__ import annotations

import concurrent.futures as cf
import typing
from collections.abc import Callable
from dataclasses import dataclass

if typing.TYPE_CHECKING:  # annotations only: the scoring path runs without pydantic (engines/rewards/config.py)
    from engines.rewards.config import JudgeConfig, RewardModelConfig

    ModelRewardConfig = JudgeConfig | RewardModelConfig

MODEL_REWARDS = ("judge", "reward_model")



@dataclass(frozen=True)
class RewardPlacement:
    """Where a reward worker's models live: the reward role's device and dtype (infra/resources.py
    `role_devices`, placement.reward), as the strings engines/models/devices.py reads."""

    device: str = "cpu"
    dtype: str = "float32"


# (responses, samples) -> [(score, None) or (0.0, error)], one per response
BatchScorer = Callable[[list[str], list[dict]], list[tuple[float, str | None]]]


def _placement(placement: RewardPlacement):
    """(torch device, torch dtype) of the reward role."""
    from engines.models.devices import torch_device, torch_dtype

    return torch_device(placement.device, "reward"), torch_dtype(placement.dtype)


def build_judge(cfg: JudgeConfig, placement: RewardPlacement) -> BatchScorer:
    """The judge of `reward.judge`: its causal LM in an `hf` generation engine, cast to the reward
    role's dtype on its device."""
    from engines.models.devices import place_model
    from engines.generation.engine import HFGenerationEngine
    from engines.models.modeling import load_policy
    from engines.rewards.judge import DEFAULT_RUBRIC, JudgeReward
    from engines.rewards.reward_model import local_model_dir

    device, dtype = _placement(placement)
    with local_model_dir(cfg.model) as path:
        model, tokenizer = load_policy(path, dtype=dtype)
    engine = HFGenerationEngine(place_model(model, device, dtype), tokenizer, micro_batch=cfg.batch_size)
    judge = JudgeReward(engine, tokenizer, cfg.rubric or DEFAULT_RUBRIC, cfg.max_new_tokens, scale=cfg.scale,
                        max_prompt_tokens=cfg.max_prompt_tokens, use_chat_template=cfg.apply_chat_template)
    return judge.score_batch


def build_reward_model(cfg: RewardModelConfig, placement: RewardPlacement) -> BatchScorer:
    """The reward model of `reward.reward_model`, scoring sample["prompt"] + response."""
    from engines.rewards.reward_model import RewardModelScorer

    device, dtype = _placement(placement)
    scorer = RewardModelScorer(cfg.model, batch_size=cfg.batch_size, device=str(device), dtype=dtype, normalize=cfg.normalize,
                               shift=cfg.shift, scale=cfg.scale, label_index=cfg.label_index, max_length=cfg.max_length,
                               use_chat_template=cfg.apply_chat_template)

    def score(responses: list[str], samples: list[dict]) -> list[tuple[float, str | None]]:
        return [(v, None) for v in scorer.score_batch([s.get("prompt", "") for s in samples], responses)]

    return score


BUILDERS: dict[str, Callable[["ModelRewardConfig", RewardPlacement], BatchScorer]] = {"judge": build_judge, "reward_model": build_reward_model}


class ModelRewards:
    """The model rewards of one reward worker: built once, kept, called in timed chunks in `pool`."""

    def __init__(self, pool: cf.ThreadPoolExecutor):
        self.pool = pool
        self.scorers: dict[str, tuple[tuple, BatchScorer]] = {}   # name -> ((its config, placement), scorer)
        self.stats = {name: {"builds": 0, "calls": 0, "samples": 0} for name in MODEL_REWARDS}

    def _scorer(self, name: str, cfg: ModelRewardConfig | None,
                placement: RewardPlacement) -> tuple[BatchScorer | None, str | None, bool]:
        """(scorer, None, False), or (None, why not, hung)."""
        if cfg is None or not cfg.model:
            return None, f"reward.{name}.model is not set, but this sample's domain routes to {name!r}", False
        key = (cfg, placement)   # both frozen: another model or setting builds anew
        if name in self.scorers and self.scorers[name][0] == key:
            return self.scorers[name][1], None, False
        fut = self.pool.submit(BUILDERS[name], cfg, placement)
        try:
            scorer = fut.result(timeout=cfg.load_timeout_s)
        except cf.TimeoutError:
            return None, f"{name} model {cfg.model!r} did not load within {cfg.load_timeout_s}s", True
        except Exception as e:  # noqa: BLE001 -- a bad model costs the samples routed to it
            return None, f"{name} model {cfg.model!r} could not be loaded: {type(e).__name__}: {e}"[:500], False
        self.scorers[name] = (key, scorer)
        self.stats[name]["builds"] += 1
        return scorer, None, False

    def _call(self, name: str, scorer: BatchScorer, responses: list[str], samples: list[dict],
              timeout_s: float) -> tuple[list[tuple[float, str | None]] | None, str | None, bool]:
        """(results, None, False), or (None, error, hung) when the call raised or timed out."""
        self.stats[name]["calls"] += 1
        self.stats[name]["samples"] += len(responses)
        fut = self.pool.submit(scorer, responses, samples)
        try:
            results = fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            return None, f"{name} call on {len(responses)} samples: timeout after {timeout_s}s", True
        except Exception as e:  # noqa: BLE001 -- costs this call's samples, never the batch
            return None, f"{type(e).__name__}: {e}"[:500], False
        if len(results) != len(responses):
            return None, f"{name} returned {len(results)} scores for {len(responses)} samples", False
        out = []
        for score, error in results:
            score = float(score)
            out.append((0.0, error or "reward is NaN") if error or score != score else (score, None))
        return out, None, False

    def score(self, name: str, cfg: ModelRewardConfig | None, responses: list[str], samples: list[dict],
              placement: RewardPlacement = RewardPlacement()) -> tuple[list[tuple[float, str | None]], bool]:
        """([(reward, error)] per sample, hung) for samples routed to model reward `name` (its config section
        `cfg`: reward.judge or reward.reward_model), its model built on `placement`."""
        scorer, error, hung = self._scorer(name, cfg, placement)
        if scorer is None:
            return [(0.0, error)] * len(responses), hung
        size, timeout = cfg.batch_size, cfg.timeout_s
        out: list[tuple[float, str | None]] = []
        for start in range(0, len(responses), size):
            rs, ss = responses[start : start + size], samples[start : start + size]
            results, error, chunk_hung = self._call(name, scorer, rs, ss, timeout)
            hung |= chunk_hung
            if results is None and not chunk_hung and len(rs) > 1:  # find the sample(s) that raise
                results = []
                for r, s in zip(rs, ss):
                    one, one_error, one_hung = self._call(name, scorer, [r], [s], timeout)
                    hung |= one_hung
                    results.extend(one or [(0.0, one_error)])
            out.extend(results or [(0.0, error)] * len(rs))
        return out, hung
