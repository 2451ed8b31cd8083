"""What crosses a task boundary: small frozen dataclasses of URIs, keys and scalars (never tensors).

The rollout batch itself travels as a pandas DataFrame (Flyte StructuredDataset, parquet), one row
per sample; its columns are declared once in engines/data/rollout_table.py `COLUMNS`, beside its
conversion to the `RolloutBatch` the engines take.
"""

from __future__ import annotations

from dataclasses import dataclass


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
