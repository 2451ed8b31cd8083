"""`flyroll lineage`: the chain of a policy version back to its base model, and the data it saw.

    flyroll lineage 12                               # MLflow model version 12 of flyroll-policy
    flyroll lineage runs/tiny-ac0eb5873272/policy/v0020   # an artifact-store key
    flyroll lineage 94c59585c8b141e6849553a32611d49b # an MLflow run id: its final policy

Walks the manifests' `parents` in the artifact store (the source of truth; hashes included), and
adds what MLflow knows about each version (model version, run, Flyte execution id).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from infra import tracking
from infra.store import ArtifactStore, StoreError


def _default_store() -> str:
    return os.environ.get("FLYROLL_STORE_URI") or os.path.abspath("runs/store")


def _default_tracking() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('runs/mlflow.db')}"


def resolve_key(target: str, store: ArtifactStore, tracking_uri: str) -> str:
    """A store key from a model version number, a run id or a key/URI."""
    if target.startswith(store.root):
        return target[len(store.root) :].lstrip("/")
    if "/" in target:
        return target
    c = tracking.client(tracking_uri)
    if target.isdigit():
        mv = c.get_model_version(tracking.REGISTERED_MODEL, target)
        return mv.tags.get("flyroll.key") or mv.source[len(store.root) :].lstrip("/")
    run = c.get_run(target)
    key = run.data.tags.get("flyroll.final_policy")
    if not key:
        raise ValueError(f"MLflow run {target} has no published final policy (tag flyroll.final_policy)")
    return key


def chain(key: str, store: ArtifactStore) -> list[dict]:
    """[this version, its parent, ..., the base model], each with kind, producer, metadata, dataset."""
    out, seen = [], set()
    while key and key not in seen:
        seen.add(key)
        m = store.manifest(key)
        out.append({"key": key, "kind": m.kind, "producer": m.producer, "created_at": m.created_at,
                    "execution_id": m.execution_id, "parents": m.parents, "files": len(m.files),
                    "metadata": {k: v for k, v in m.metadata.items() if k not in ("bootstrap",)}})
        key = m.parents[0] if m.parents else None
    return out


def lineage(target: str, store_uri: str, tracking_uri: str) -> dict:
    store = ArtifactStore(store_uri)
    key = resolve_key(target, store, tracking_uri)
    versions = chain(key, store)
    datasets = sorted({v["metadata"].get("dataset") for v in versions if v["metadata"].get("dataset")})
    data = []
    for d in datasets:
        try:
            dm = store.manifest(d)
            data.append({"key": d, "rows": dm.metadata.get("rows"), "domains": dm.metadata.get("domains"),
                         "files": {n: f.sha256[:16] for n, f in dm.files.items()},
                         # the fingerprints of the files the dataset was built from (engines/fingerprint.py)
                         "inputs": {u: f.get("digest") for u, f in (dm.metadata.get("inputs") or {}).items()}})
        except StoreError as e:
            data.append({"key": d, "error": str(e)})
    try:  # MLflow's view of each policy version
        c = tracking.client(tracking_uri)
        by_source = {mv.source: mv for mv in c.search_model_versions(f"name='{tracking.REGISTERED_MODEL}'")}
        for v in versions:
            mv = by_source.get(store.uri(v["key"]))
            if mv is not None:
                mv = c.get_model_version(tracking.REGISTERED_MODEL, mv.version)  # search results carry no aliases
                v["mlflow"] = {"model_version": mv.version, "run_id": mv.run_id, "aliases": list(mv.aliases or []),
                               "flyte_execution_id": mv.tags.get("flyte.execution_id")}
    except Exception as e:  # noqa: BLE001 -- lineage from the store alone is still complete
        versions[0]["mlflow_error"] = str(e)
    return {"target": target, "policy": key, "base_model": versions[-1]["key"], "chain": versions, "datasets": data}


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flyroll lineage", description=__doc__.split("\n")[0])
    p.add_argument("target", help="MLflow model version number, MLflow run id, or artifact-store key")
    p.add_argument("--store", default=_default_store(), help="artifact store root (default $FLYROLL_STORE_URI or ./runs/store)")
    p.add_argument("--tracking-uri", default=_default_tracking(), help="MLflow URI (default $MLFLOW_TRACKING_URI or ./runs/mlflow.db)")
    p.add_argument("--json", action="store_true", help="print the whole record as JSON")
    args = p.parse_args(argv)
    from mlflow.exceptions import MlflowException

    try:
        rec = lineage(args.target, args.store, args.tracking_uri)
    except (StoreError, ValueError, MlflowException) as e:
        print(f"flyroll lineage: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rec, indent=2, default=str))
        return 0
    for i, v in enumerate(rec["chain"]):
        mv = v.get("mlflow", {})
        tag = f"  (MLflow model version {mv['model_version']}, run {mv['run_id'][:8]})" if mv else ""
        it = v["metadata"].get("iteration")
        print(f"{'  ← ' if i else ''}{v['key']}  [{v['kind']} by {v['producer']}{f', iteration {it}' if it is not None else ''}]{tag}")
    for d in rec["datasets"]:
        inputs = "".join(f", from {u} ({digest})" for u, digest in (d.get("inputs") or {}).items())
        print(f"dataset {d['key']}: {d.get('rows')} rows, domains {d.get('domains')}{inputs}")
    return 0
