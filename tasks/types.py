"""What crosses a task boundary: small frozen dataclasses of URIs, keys and scalars (never tensors).

The rollout batch itself travels as a pandas DataFrame (Flyte StructuredDataset, parquet), one row
per sample; each stage only adds columns. `COLUMNS` below is the one declaration of them (name,
dtype, meaning, the stage that writes it); tasks/common.py `check_columns` checks a table against it
at every stage boundary, and docs/data.md points here rather than copying it.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("rollout", "scoring", "reference")  # in order; each adds its columns to the table
DTYPES = ("int", "float", "bool", "str", "list[int]", "list[float]")


@dataclass(frozen=True)
class Column:
    """One column of the rollout table.

    name:     column name
    dtype:    one of DTYPES: "float" also takes integers; "list[...]" is a list, tuple or numpy array
              (parquet gives arrays back) of that element type
    meaning:  what it holds
    writer:   the stage that adds it (STAGES); agentic rows (tasks/agentic.py) are written by
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
    # rollout (tasks/rollout.py completion_rows; tasks/agentic.py episode_rows)
    Column("prompt_id", "str", "id of the prompt in the train split (agentic: seed-<env seed>)", _R),
    Column("group_id", "str", "<iteration>:<prompt id>; the samples of one prompt (GRPO group) share it (partial "
           "rollout: the iteration its first segment was generated in)", _R),
    Column("sample_id", "int", "0..G-1 within the group", _R),
    Column("domain", "str", "routes the reward (agentic: the environment's name)", _R),
    Column("prompt", "str", "prompt text as given to the tokenizer", _R),
    Column("answer", "str", "reference final answer (None for code tests and environments)", _R, nullable=True),
    Column("tests", "str", "code tests as JSON text (engines/datasets.py encode_nested), copied from the prompt table",
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
    # rollout, agentic only (tasks/agentic.py; engines/env_manager.py Episode)
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
    # scoring (tasks/scoring.py with_rewards; tasks/agentic.py score_episodes)
    Column("reward", "float", "the sample's reward (a failed reward call: 0)", _S),
    Column("reward_error", "str", "why the reward call failed", _S, nullable=True),
    Column("reward_isolation", "str", "the code sandbox's isolation mode that scored the row (None: no sandbox)", _S,
           optional=True, nullable=True),
    # reference forward (tasks/reference.py with_logprobs)
    Column("ref_logprobs", "list[float]", "log-probs of the reference model (KL anchor)", _F, aligned=True),
    Column("old_logprobs", "list[float]", "log-probs of the policy that sampled (pi_old), recomputed, or the behaviour "
           "ones when that forward is skipped", _F, aligned=True),
    Column("values", "list[float]", "critic values V(s_t) (algorithm.advantage: gae)", _F, optional=True, aligned=True),
)
COLUMN = {c.name: c for c in COLUMNS}

# stage -> names of the columns it adds to the rollout table (optional ones included)
ROLLOUT_COLUMNS = {stage: [c.name for c in COLUMNS if c.writer == stage] for stage in STAGES}
# the token-level float columns, which the update takes as [B, T] tensors (engines/rl_step.py table_tensors)
TOKEN_FLOAT_COLUMNS = tuple(c.name for c in COLUMNS if c.aligned and c.dtype == "list[float]")


def columns_markdown() -> str:
    """`COLUMNS` as the markdown table in docs/data.md (`python -m tasks.types` prints it)."""
    lines = ["| column | dtype | written by | meaning |", "|---|---|---|---|"]
    for c in COLUMNS:
        notes = [n for n, on in (("optional", c.optional), ("may be None", c.nullable),
                                 ("one per response token", c.aligned)) if on]
        lines.append(f"| `{c.name}` | {c.dtype} | {c.writer} | {c.meaning}{' (' + '; '.join(notes) + ')' if notes else ''} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class RunSpec:
    """One workflow run.

    config_json:   the resolved, validated FlyrollConfig (JSON)
    config_hash:   12-hex hash of it (tags, cache keys)
    run_id:        stable id of this run: <run.name>-<config_hash>; artifact keys live under runs/<run_id>/
    store_uri:     artifact store root (local path or s3://bucket/prefix)
    tracking_uri:  MLflow tracking URI
    mlflow_run_id: the parent MLflow run all stages log into
    """

    config_json: str
    config_hash: str
    run_id: str
    store_uri: str
    tracking_uri: str
    mlflow_run_id: str


@dataclass(frozen=True)
class PolicyRef:
    """A published policy version.

    key:       artifact-store key of the checkpoint (safetensors + tokenizer + config + MANIFEST.json)
    version:   0 for the starting policy, then the iteration that produced it
    model_version: MLflow registered-model version ("" when not registered, e.g. the base)
    """

    key: str
    version: int
    model_version: str = ""


@dataclass(frozen=True)
class DatasetRef:
    """Versioned prompt tables in the artifact store (parquet, with manifests).

    train_key / eval_key: keys of the train and eval splits (columns prompt_id, domain, prompt, answer)
    """

    train_key: str
    eval_key: str


if __name__ == "__main__":
    print(columns_markdown())
