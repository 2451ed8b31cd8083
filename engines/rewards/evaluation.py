"""Evaluation of a policy on a table of verifiable prompts: greedy accuracy and sampled pass@k, per
domain and per reasoning-gym generator.

Every row is scored by exactly the reward training gives it: `score_responses` goes through
engines/rewards/routing.py `score_samples`, the function training's reward workers run, with the
same routing (config `reward.functions`, then the row's `metadata.reward_fn`, then its domain),
model rewards (`judge`, `reward_model`) and per-call isolation (a reward that raises or times out
scores 0 and keeps its error in `reward_error`).

"Correct" is `reward >= CORRECT_AT` (1.0), as training's `reward/accuracy`: for the 0/1 rewards
(exact match, math, code, reasoning-gym's usual tasks) it is the solve rate; for graded rewards
(partial IFEval credit, a judge's rating in [0, 1], reward-model scores) it counts only full marks,
so the mean reward is reported beside it (`reward`, `reward/<domain>`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import typing

import pandas as pd

from engines.generation.engine import GenerationEngine, SamplingParams
from engines.models.modeling import encode_prompts
from engines.rewards.models import RewardPlacement

if typing.TYPE_CHECKING:  # annotations only: evaluation runs without pydantic (engines/rewards/config.py)
    from engines.rewards.config import RewardConfig

CORRECT_AT = 1.0  # a row is correct when its reward reaches this (training's reward/accuracy)


def generate_responses(engine: GenerationEngine, tokenizer, table: pd.DataFrame, *, max_new_tokens: int,
                       apply_chat_template: bool = False, stop: tuple[str, ...] = (), samples: int = 0,
                       temperature: float = 1.0, seed: int = 0) -> pd.DataFrame:
    """Responses to every prompt of `table`: one greedy response (samples=0), or `samples` responses
    sampled at `temperature` with a fixed `seed` (every checkpoint is sampled with the same draws).
    Returns the table's rows (prompt order, then sample order) plus `eval_index` (the prompt's
    row), `sample_index`, `response`, `response_length`. `stop`: stop strings, as the rollout's."""
    ids = encode_prompts(tokenizer, table["prompt"].tolist(), apply_chat_template)
    params = (SamplingParams(n=samples, temperature=temperature, max_new_tokens=max_new_tokens, stop=tuple(stop), seed=seed)
              if samples else SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=tuple(stop)))
    completions = engine.generate(ids, params)
    rows = []
    for c in sorted(completions, key=lambda c: (c.prompt_index, c.sample_index)):
        rows.append({**table.iloc[c.prompt_index].to_dict(), "eval_index": c.prompt_index, "sample_index": c.sample_index,
                     "response": c.text, "response_length": len(c.token_ids)})
    return pd.DataFrame(rows)


def score_responses(results: pd.DataFrame, *, reward: RewardConfig | None = None,
                    placement: RewardPlacement = RewardPlacement()) -> pd.DataFrame:
    """`results` plus `reward` and `reward_error`, scored in this process by training's scoring path
    (`score_samples`) with the config's `reward` section (None: its defaults), model rewards on `placement`."""
    from engines.rewards.calls import RewardCalls
    from engines.rewards.models import ModelRewards
    from engines.rewards.routing import score_samples

    keep = [c for c in ("prompt", "answer", "domain", "tests", "metadata") if c in results.columns]
    items = [(row["domain"], row["response"], {k: row[k] for k in keep}) for _, row in results.iterrows()]
    reward = reward or _default_reward()
    pool = cf.ThreadPoolExecutor(max_workers=4)   # the model rewards' timed calls
    try:
        with RewardCalls(reward.processes) as calls:
            scored, _hung = score_samples(items, reward, calls, ModelRewards(pool), placement)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a hung model-reward call leaves its thread behind
    out = results.copy()
    out["reward"] = [float(r) for r, _ in scored]
    out["reward_error"] = pd.Series([e for _, e in scored], index=out.index, dtype=object)
    return out


def _default_reward() -> RewardConfig:
    from engines.rewards.config import RewardConfig

    return RewardConfig()


def task_of(metadata) -> str | None:
    """The generator that made a row (reasoning-gym's `rg_dataset`), read from a dict or its JSON text."""
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except ValueError:
            return None
    return metadata.get("rg_dataset") if isinstance(metadata, dict) else None


def _groups(results: pd.DataFrame):
    """(suffix, rows, is_domain) per domain, and per domain/generator for rows that name their generator."""
    for domain, grp in results.groupby("domain"):
        yield f"/{domain}", grp, True
    if "metadata" in results.columns:
        tasks = results["metadata"].map(task_of)
        for (domain, task), grp in results.groupby([results["domain"], tasks]):
            yield f"/{domain}/{task}", grp, False


def eval_metrics(results: pd.DataFrame) -> dict[str, float]:
    """{"accuracy", "reward", "length", "errors"} of scored greedy rows, and "accuracy/<domain>",
    "reward/<domain>", "errors/<domain>", plus "accuracy/<domain>/<generator>" for reasoning-gym rows;
    accuracy = share of rows with reward >= CORRECT_AT, reward = mean reward, errors = rows whose reward
    failed (their reward_error is set: they count as 0, not as wrong answers the model gave)."""
    correct = results["reward"] >= CORRECT_AT
    failed = results["reward_error"].notna() if "reward_error" in results.columns else pd.Series(False, index=results.index)
    metrics = {"accuracy": float(correct.mean()), "reward": float(results["reward"].mean()),
               "length": float(results["response_length"].mean()), "errors": float(failed.sum())}
    for suffix, grp, is_domain in _groups(results):
        metrics[f"accuracy{suffix}"] = float((grp["reward"] >= CORRECT_AT).mean())
        if is_domain:
            metrics[f"reward{suffix}"] = float(grp["reward"].mean())
            metrics[f"errors{suffix}"] = float(failed[grp.index].sum())
    return metrics


def sampled_metrics(results: pd.DataFrame, k: int) -> dict[str, float]:
    """From scored rows with k samples per prompt (`generate_responses(samples=k)`):
    "pass_at_k" (share of prompts with at least one correct sample) and "sampled_accuracy" (share of
    correct samples), overall, per domain and per generator, as `eval_metrics` names them."""
    out: dict[str, float] = {}
    for suffix, grp, _ in [("", results, False), *_groups(results)]:
        solved = (grp["reward"] >= CORRECT_AT).groupby(grp["eval_index"]).any()
        out[f"pass_at_{k}{suffix}"] = float(solved.mean())
        out[f"sampled_accuracy{suffix}"] = float((grp["reward"] >= CORRECT_AT).mean())
    return out


def evaluate(
    engine: GenerationEngine,
    tokenizer,
    table: pd.DataFrame,
    *,
    max_new_tokens: int,
    apply_chat_template: bool = False,
    reward: RewardConfig | None = None,
    stop: tuple[str, ...] = (),
    samples: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[dict[str, float], pd.DataFrame]:
    """Greedy-decode every prompt of `table` (columns prompt, domain, answer[, tests, metadata]) and
    score it with the reward training routes it to (`score_responses`). With `samples` = k > 0, also
    sample k responses per prompt (`temperature`, fixed `seed`) and add `sampled_metrics` (pass@k).
    Returns (metrics, per-row greedy results with response, reward, reward_error, response_length). Raises
    RewardErrorRate when a domain's reward fails on more than reward.max_error_rate of the rows (an
    accuracy of 0 would read as a model that answered nothing right)."""
    results = generate_responses(engine, tokenizer, table, max_new_tokens=max_new_tokens, apply_chat_template=apply_chat_template,
                                 stop=stop)
    from engines.rewards.routing import check_error_rate

    results = score_responses(results, reward=reward)
    metrics = eval_metrics(results)
    check_error_rate([(str(r["domain"]), {"metadata": r.get("metadata")}, r["reward_error"]) for _, r in results.iterrows()],
                     reward or _default_reward(), "evaluation")
    if samples:
        sampled = generate_responses(engine, tokenizer, table, max_new_tokens=max_new_tokens, apply_chat_template=apply_chat_template,
                                     stop=stop, samples=samples, temperature=temperature, seed=seed)
        metrics.update(sampled_metrics(score_responses(sampled, reward=reward), samples))
    return metrics, results
