"""The rollout table: its column schema (`COLUMNS`) and its one conversion to tensors (`batch_from_table`).

Between tasks the rollout batch travels as a pandas DataFrame (Flyte StructuredDataset, parquet),
one row per sample; each stage only adds columns. `COLUMNS` below is the one declaration of them
(name, dtype, meaning, the stage that writes it); tasks/run/common.py `check_columns` checks a table
against it at every stage boundary, and docs/data.md points here rather than copying it
(`python -m engines.data.rollout_table` prints its table).

Inside the engines the table is a `RolloutBatch` (engines/training/rollout_batch.py), built once per
actor call by `batch_from_table` (the only DataFrame -> tensor conversion of the update path): the
reference actor's forwards and the critic's and actor's updates all read its tensors.
Notation: B rows (= prompts × G samples), T response width, K turns (agentic).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from engines.algorithms.gigpo import gigpo_step_tensors
from engines.models.batching import collate
from engines.training.rollout_batch import RolloutBatch

STAGES = ("rollout", "scoring", "reference")  # in order; each adds its columns to the table
DTYPES = ("int", "float", "bool", "str", "list[int]", "list[float]")


@dataclass(frozen=True)
class Column:
    """One column of the rollout table.

    name:     column name
    dtype:    one of DTYPES: "float" also takes integers; "list[...]" is a list, tuple or numpy array
              (parquet gives arrays back) of that element type
    meaning:  what it holds
    writer:   the stage that adds it (STAGES); agentic rows (tasks/stages/agentic.py) are written by
              `rollout_episodes` / `score_episodes`, the rollout and scoring stages of workflows/agentic.py
    optional: only some paths write it (the agentic ones, the critic's); checked when present
    nullable: None (or NaN) is allowed
    aligned:  token-level: one entry per token of `response_token_ids` (same length in every row)
    """

    name: str
    dtype: str
    meaning: str
    writer: str
    optional: bool = False
    nullable: bool = False
    aligned: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES or self.writer not in STAGES:
            raise ValueError(f"column {self.name!r}: dtype must be one of {DTYPES} and writer one of {STAGES}, "
                             f"got dtype {self.dtype!r}, writer {self.writer!r}")


_R, _S, _F = "rollout", "scoring", "reference"
COLUMNS: tuple[Column, ...] = (
    # rollout (tasks/actors/pools.py completion_rows; tasks/stages/agentic.py episode_rows)
    Column("prompt_id", "str", "id of the prompt in the train split (agentic: seed-<env seed>)", _R),
    Column("group_id", "str", "<iteration>:<prompt id>; the samples of one prompt (GRPO group) share it (partial "
           "rollout: the iteration its first segment was generated in)", _R),
    Column("sample_id", "int", "0..G-1 within the group", _R),
    Column("domain", "str", "routes the reward (agentic: the environment's name)", _R),
    Column("prompt", "str", "prompt text as given to the tokenizer", _R),
    Column("answer", "str", "reference final answer (None for code tests and environments)", _R, nullable=True),
    Column("tests", "str", "code tests as JSON text (engines/data/datasets.py encode_nested), copied from the prompt table",
           _R, optional=True, nullable=True),
    Column("metadata", "str", "what a reward needs besides the answer, as JSON text, copied from the prompt table",
           _R, optional=True, nullable=True),
    Column("prompt_token_ids", "list[int]", "prompt tokens exactly as the policy saw them", _R),
    Column("response", "str", "decoded response (agentic: the transcript of all turns)", _R),
    Column("response_token_ids", "list[int]", "response tokens exactly as sampled (agentic: a_1 o_1 a_2 ...)", _R),
    Column("behaviour_logprobs", "list[float]", "the generation engine's log-prob of each response token", _R,
           aligned=True),
    Column("finish_reason", "str", "stop or length (agentic: done, max_turns, truncated or env_error)", _R),
    Column("policy_version", "int", "version of the policy that generated the sample (lineage); partial rollout: "
           "that of its last segment", _R),
    Column("policy_versions", "list[int]", "partial rollout (rollout.partial_rollout_max_split > 1): the policy version "
           "of each generated segment, oldest first", _R, optional=True),
    # rollout, agentic only (tasks/stages/agentic.py; engines/agentic/env_manager.py Episode)
    Column("loss_mask", "list[int]", "agentic: 1 on the policy's own tokens, 0 on environment tokens", _R, optional=True,
           aligned=True),
    Column("turn_index", "list[int]", "agentic: turn (0-based) of each policy token, -1 on environment tokens", _R,
           optional=True, aligned=True),
    Column("turn_rewards", "list[float]", "agentic: reward of each turn", _R, optional=True),
    Column("state_keys", "str", "agentic: environment state before each action, JSON list (GiGPO anchors)", _R,
           optional=True),
    Column("env_return", "float", "agentic: the episode's return (sum of turn rewards)", _R, optional=True),
    Column("success", "bool", "agentic: the environment counted the episode as solved", _R, optional=True),
    Column("turns", "int", "agentic: actions taken", _R, optional=True),
    Column("num_effective", "int", "agentic: actions that changed the environment's state", _R, optional=True),
    Column("num_invalid", "int", "agentic: actions that were not valid (not parsed, or not legal)", _R, optional=True),
    Column("env_error", "str", "agentic: the exception an env.step raised", _R, optional=True, nullable=True),
    # scoring (tasks/actors/pools.py with_rewards; tasks/stages/agentic.py score_episodes)
    Column("reward", "float", "the sample's reward (a failed reward call: 0)", _S),
    Column("reward_error", "str", "why the reward call failed", _S, nullable=True),
    Column("reward_isolation", "str", "the code sandbox's isolation mode that scored the row (None: no sandbox)", _S,
           optional=True, nullable=True),
    # reference forward (tasks/stages/reference.py with_logprobs)
    Column("ref_logprobs", "list[float]", "log-probs of the reference model (KL anchor)", _F, aligned=True),
    Column("old_logprobs", "list[float]", "log-probs of the policy that sampled (pi_old), recomputed, or the behaviour "
           "ones when that forward is skipped", _F, aligned=True),
    Column("values", "list[float]", "critic values V(s_t) (algorithm.advantage: gae)", _F, optional=True, aligned=True),
)
COLUMN = {c.name: c for c in COLUMNS}

# stage -> names of the columns it adds to the rollout table (optional ones included)
ROLLOUT_COLUMNS = {stage: [c.name for c in COLUMNS if c.writer == stage] for stage in STAGES}
# the token-level float columns, which the update takes as [B, T] tensors (`RolloutBatch` fields)
TOKEN_FLOAT_COLUMNS = tuple(c.name for c in COLUMNS if c.aligned and c.dtype == "list[float]")


def columns_markdown() -> str:
    """`COLUMNS` as the markdown table in docs/data.md (`python -m engines.data.rollout_table` prints it)."""
    lines = ["| column | dtype | written by | meaning |", "|---|---|---|---|"]
    for c in COLUMNS:
        notes = [n for n, on in (("optional", c.optional), ("may be None", c.nullable),
                                 ("one per response token", c.aligned)) if on]
        lines.append(f"| `{c.name}` | {c.dtype} | {c.writer} | {c.meaning}{' (' + '; '.join(notes) + ')' if notes else ''} |")
    return "\n".join(lines)


def _as_list(x) -> list:
    return x.tolist() if isinstance(x, np.ndarray) else list(x)


def _token_column(df: pd.DataFrame, column: str, width: int) -> torch.Tensor:
    """A list-valued token-level column -> [B, width] float32, zero-padded on the right."""
    out = torch.zeros((len(df), width), dtype=torch.float32)
    for i, v in enumerate(df[column]):
        v = _as_list(v)[:width]
        if v:
            out[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out



def batch_from_table(df: pd.DataFrame, pad_id: int) -> RolloutBatch:
    """The one conversion of a rollout table (rows in table order) to tensors. `pad_id`: any
    id (padding is masked out), the tokenizer's pad token by convention."""
    masks = [_as_list(m) for m in df["loss_mask"]] if "loss_mask" in df.columns else None
    responses = [_as_list(r) for r in df["response_token_ids"]]
    tokens = collate([_as_list(p) for p in df["prompt_token_ids"]], responses, pad_id, loss_masks=masks)
    T = tokens.responses.shape[1]
    token = {c: _token_column(df, c, T) for c in TOKEN_FLOAT_COLUMNS if c in df.columns}
    steps = {}
    if {"turn_index", "turn_rewards", "state_keys"} <= set(df.columns):
        keys = [json.loads(k) if isinstance(k, str) else list(k) for k in df["state_keys"]]
        steps = gigpo_step_tensors([_as_list(t) for t in df["turn_index"]], [_as_list(r) for r in df["turn_rewards"]],
                                   keys, width=T)
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.position_ids, tokens.responses, tokens.response_mask,
        response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.long),
        scores=torch.as_tensor(df["reward"].to_numpy(dtype=np.float32)) if "reward" in df.columns else None,
        group_index=(torch.as_tensor(pd.factorize(df["group_id"])[0], dtype=torch.long)
                     if "group_id" in df.columns else None),
        truncated=(torch.as_tensor((df["finish_reason"] == "length").to_numpy().copy())
                   if "finish_reason" in df.columns else None),
        **token, **steps,
    )


if __name__ == "__main__":
    print(columns_markdown())
