"""`flyroll lineage`: the chain of a policy version back to its base model, and the data it saw.

    flyroll lineage 12                               # MLflow model version 12 of flyroll-policy
    flyroll lineage 12 --model acme-policy           # ... of another registered model (run.model_name)
    flyroll lineage runs/tiny-ac0eb5873272/policy/v0020   # an artifact-store key
    flyroll lineage 94c59585c8b141e6849553a32611d49b # an MLflow run id: its final policy

Walks the manifests' `parents` in the artifact store (the source of truth; hashes included), and
adds what MLflow knows about each version (model version, run, Flyte execution id), from the
registered model each checkpoint's manifest names (`registered_model`), else `--model`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from configs.schema import RunConfig
from infra import tracking
from infra.store import ArtifactStore, StoreError


def _default_store() -> str:
    return os.environ.get("FLYROLL_STORE_URI") or os.path.abspath("runs/store")


def _default_tracking() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('runs/mlflow.db')}"


DEFAULT_MODEL = RunConfig().registered_model   # flyroll-policy: the default config's


def resolve_key(target: str, store: ArtifactStore, tracking_uri: str, model: str = DEFAULT_MODEL) -> str:
    """A store key from a version number of registered model `model`, a run id or a key/URI."""
    if target.startswith(store.root):
        return target[len(store.root) :].lstrip("/")
    if "/" in target:
        return target
    c = tracking.client(tracking_uri)
    if target.isdigit():
        mv = c.get_model_version(model, target)
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
                    "run_kind": run_kind({"metadata": m.metadata}),
                    "execution_id": m.execution_id, "parents": m.parents, "files": len(m.files),
                    "metadata": {k: v for k, v in m.metadata.items() if k not in ("bootstrap",)}})
        key = m.parents[0] if m.parents else None
    return out


def run_kind(version: dict) -> str | None:
    """What trained a published policy version (a `chain` entry): its manifest's `kind` ("sft", "dpo",
    "distill", "on_policy_distill"; tasks/stages/weight_sync.py), else "rl" when it names its rollout
    table; None for a base or imported model."""
    meta = version["metadata"]
    return meta.get("kind") or ("rl" if "rollout_table" in meta else None)


def lineage(target: str, store_uri: str, tracking_uri: str, model: str = DEFAULT_MODEL) -> dict:
    store = ArtifactStore(store_uri)
    key = resolve_key(target, store, tracking_uri, model)
    versions = chain(key, store)
    datasets = sorted({v["metadata"].get("dataset") for v in versions if v["metadata"].get("dataset")})
    data = []
    for d in datasets:
        try:
            dm = store.manifest(d)
            data.append({"key": d, "rows": dm.metadata.get("rows"), "domains": dm.metadata.get("domains"),
                         "files": {n: f.sha256[:16] for n, f in dm.files.items()},
                         # the fingerprints of the files the dataset was built from (engines/data/fingerprint.py)
                         "inputs": {u: f.get("digest") for u, f in (dm.metadata.get("inputs") or {}).items()}})
        except StoreError as e:
            data.append({"key": d, "error": str(e)})
    try:  # MLflow's view of each policy version
        c = tracking.client(tracking_uri)
        names = {v["metadata"].get("registered_model") or model for v in versions if v["kind"] == "checkpoint"}
        by_source = {mv.source: mv for name in sorted(names) for mv in c.search_model_versions(f"name='{name}'")}
        for v in versions:
            mv = by_source.get(store.uri(v["key"]))
            if mv is not None:
                mv = c.get_model_version(mv.name, mv.version)  # search results carry no aliases
                v["mlflow"] = {"registered_model": mv.name, "model_version": mv.version, "run_id": mv.run_id, "aliases": list(mv.aliases or []),
                               "flyte_execution_id": mv.tags.get("flyte.execution_id")}
    except Exception as e:  # noqa: BLE001 -- lineage from the store alone is still complete
        versions[0]["mlflow_error"] = str(e)
    return {"target": target, "policy": key, "base_model": versions[-1]["key"], "chain": versions, "datasets": data}


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flyroll lineage", description=__doc__.split("\n")[0])
    p.add_argument("target", help="MLflow model version number, MLflow run id, or artifact-store key")
    p.add_argument("--store", default=_default_store(), help="artifact store root (default $FLYROLL_STORE_URI or ./runs/store)")
    p.add_argument("--tracking-uri", default=_default_tracking(), help="MLflow URI (default $MLFLOW_TRACKING_URI or ./runs/mlflow.db)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered model a version number refers to, and of checkpoints whose manifest names none (default {DEFAULT_MODEL}; a config's run.model_name)")
    p.add_argument("--json", action="store_true", help="print the whole record as JSON")
    args = p.parse_args(argv)
    from mlflow.exceptions import MlflowException

    try:
        rec = lineage(args.target, args.store, args.tracking_uri, args.model)
    except (StoreError, ValueError, MlflowException) as e:
        print(f"flyroll lineage: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rec, indent=2, default=str))
        return 0
    for i, v in enumerate(rec["chain"]):
        mv = v.get("mlflow", {})
        tag = f"  (MLflow model version {mv['model_version']} of {mv['registered_model']}, run {mv['run_id'][:8]})" if mv else ""
        it, step = v["metadata"].get("iteration"), run_kind(v)
        detail = f", {step} {'iteration' if 'rollout_table' in v['metadata'] else 'version'} {it}" if it is not None else ""
        detail += f", config {v['metadata']['config_hash']}" if v["metadata"].get("config_hash") else ""
        detail += f", data {v['metadata']['dataset']}" if v["metadata"].get("dataset") and it is not None else ""
        print(f"{'  ← ' if i else ''}{v['key']}  [{v['kind']} by {v['producer']}{detail}]{tag}")
        for s in v["metadata"].get("unpublished_iterations") or []:  # checkpoint.publish_every (tasks/loop/publish_plan.py)
            print(f"      after iteration {s['iteration']} (not published; trained on {s['rollout_table']})")
    for d in rec["datasets"]:
        inputs = "".join(f", from {u} ({digest})" for u, digest in (d.get("inputs") or {}).items())
        print(f"dataset {d['key']}: {d.get('rows')} rows, domains {d.get('domains')}{inputs}")
    return 0


# ------------------------------------------------------------------ lineage on the run page and in report.html

CHAIN_SHOWN = 6   # versions of the parent chain named on the run page / in the report; `flyroll lineage` has all


def summary_rows(rec: dict, config_hash: str) -> list[tuple[str, str]]:
    """The lineage of a final policy as (label, value) rows: policy, model version, base model,
    dataset versions, config hash and the parent chain (newest first, the middle elided past
    CHAIN_SHOWN versions). `rec` is a `lineage()` record."""
    mv = rec["chain"][0].get("mlflow", {})
    keys = [v["key"] for v in rec["chain"]]
    shown = keys if len(keys) <= CHAIN_SHOWN else [*keys[:CHAIN_SHOWN - 1], f"… {len(keys) - CHAIN_SHOWN} more …", keys[-1]]
    data = [f"{d['key']} ({d['rows']} rows)" if d.get("rows") is not None else d["key"] for d in rec["datasets"]]
    return [("final policy", rec["policy"]),
            ("model version", f"{mv['registered_model']} v{mv['model_version']}" if mv else "not registered"),
            ("base model", rec["base_model"]),
            ("dataset", "; ".join(data) or "none recorded"),
            ("config hash", config_hash),
            ("parent chain", " ← ".join(shown))]


def _md(text: str) -> str:
    """Text for a markdown table cell: pipes and markdown punctuation escaped."""
    return "".join("\\" + ch if ch in "\\`*_{}[]<>|#" else ch for ch in str(text))


def key_charts(history: dict[str, list[tuple[int, float]]], keys: tuple[str, ...], experiment_id: str,
               run_id: str) -> list[tuple[str, str, str]]:
    """(metric, "before → after (×ratio), iteration i → j", link to MLflow's metric page) for each
    of `keys` that has points in `history` ({key: [(iteration, value), ...]}, sorted by iteration)."""
    from infra.decks import gain_text

    out = []
    for k in keys:
        if pts := history.get(k):
            gain = f"{gain_text(pts[0][1], pts[-1][1])}, iteration {pts[0][0]} → {pts[-1][0]}"
            out.append((k, gain, tracking.metric_page_link(experiment_id, run_id, [k])))
    return out


def note_markdown(key_charts: list[tuple[str, str, str]], rows: list[tuple[str, str]]) -> str:
    """A run description (MLflow's `mlflow.note.content`, shown on the run page's Overview, folded
    after a few lines): the key charts as (metric, "before → after" text, link to MLflow's metric page)
    and the lineage rows, each on one line first (what shows before "Show more"), then as a table."""
    charts = " · ".join(f"[{_md(k)}]({link}) {_md(gain)}" for k, gain, link in key_charts) or "no key metric was logged"
    short = "; ".join(f"{_md(k)}: {_md(v)}" for k, v in rows if k != "parent chain")
    out = [f"**Key charts:** {charts}", "", f"**Lineage:** {short}", "", "| lineage | |", "|---|---|"]
    out += [f"| {_md(k)} | {_md(v)} |" for k, v in rows]
    out += ["", ("The Model metrics tab orders its sections alphabetically (a reordering is kept only in that browser): "
                 "the links above open each key chart on its own. `flyroll lineage <run id>` prints the whole chain.")]
    return "\n".join(out) + "\n"
