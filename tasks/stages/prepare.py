# longer than 400 lines: the run's set-up tasks (config, dataset, base policy, reference, resume point)
"""Before the loop: validate the config and open the run, build the datasets, bootstrap the policy,
import the KL reference (`model.reference_path`) and check that it shares the policy's vocabulary
(the imports and model checks themselves: tasks/run/model_import.py)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import random
import tempfile
import time
import typing

import torch
from flytekit import Cache, task
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from configs.checks import check_kind, tagged_kind
from configs.schema import load_config
from engines.data.datasets import decode_nested, encode_nested
from engines.agentic.env_manager import solved_episodes
from engines.data.fingerprint import fingerprint
from engines.models.host_memory import release_allocator_caches
from engines.models.threads import model_threads
from engines.rewards.routing import check_routes
from engines.training.pretrain import supervised_finetune
from engines.data.synthetic import make_problems, teacher_demonstration
from infra import tracking
from infra.ray_session import is_local_execution
from infra.resources import check_placement, task_resources
from infra.store import ArtifactStore, CorruptArtifact, StoreError
from infra.tracking_store import check_store, tracking_uri_source
from tasks.loop.prompts import read_table
from tasks.run.common import config_of, console, execution_id, settle_published_iteration, store_of
from tasks.run.keys import parse_policy_key, policy_prefix
from tasks.run.model_import import build_reference, check_model_path, imported_policy
from tasks.run.splits import NOT_TOKENIZER, bounded_splits, build_splits, check_train_split, context_of, data_fingerprints
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from tasks.actors.process import capped_threads
from tasks.run.seeds import BOOTSTRAP_ENV_SEED0

PrepareOut = typing.NamedTuple("PrepareOut", [("spec", RunSpec), ("model_spec", str)])


@task(**task_resources("setup"))
def prepare_run(config: str, restart: bool, overrides: typing.Optional[typing.List[str]] = None, kind: str = "rl") -> PrepareOut:
    """Validate the config with the command line's `overrides` ("key=value" items, `--set`), importing
    every reward function it names (fails here, before any cluster, naming field/value/expectation),
    print it, and open the MLflow parent run -- or find the run to resume (same name + config hash)
    unless `restart`. `kind`: the workflow's ("rl", "on_policy_distill", "sft", "dpo", "distill"); a config
    for another is refused (configs/checks.py `check_kind`), and the MLflow run is tagged `flyroll.kind`
    (`tagged_kind`: an RL run with advantage on_policy_distill is "on_policy_distill")."""
    cfg = load_config(config or None, list(overrides or []))
    check_kind(cfg, kind)
    console.print(resolved_config(config, overrides, cfg))
    check_placement(cfg)
    check_remote_uris(cfg, os.environ)
    check_remote_sync(cfg, os.environ)
    chash = cfg.hash()
    run_id = f"{cfg.run.name}-{chash}"
    if restart:
        run_id += time.strftime("-%Y%m%d%H%M%S")
    out_dir = os.path.abspath(cfg.run.output_dir)
    store_uri = cfg.run.store_uri or os.environ.get("FLYROLL_STORE_URI") or os.path.join(out_dir, "store")
    store = ArtifactStore(store_uri)
    try:  # a read-only store fails here, not at the first publish
        store.check_writable()
    except StoreError as e:
        field = "run.store_uri" if cfg.run.store_uri else "FLYROLL_STORE_URI" if os.environ.get("FLYROLL_STORE_URI") else "run.output_dir"
        raise ValueError(f"{field}: the artifact store {store_uri!r} cannot be written to ({e}); expected a writable "
                         "folder or bucket") from None
    teacher = cfg.distill.teacher if cfg.distill is not None else None
    for field, path in (("model.path", cfg.model.path), ("model.reference_path", cfg.model.reference_path),
                        ("distill.teacher", teacher)):
        if path:  # a missing or broken model fails here, not after the policy is bootstrapped
            check_model_path(path, store, field)
    # one process per run id: refused here, naming the holder, before the MLflow run is opened or resumed
    store.lock_run(run_id, execution_id=execution_id())
    verify_resume_policy(store, run_id)  # a refused rerun leaves its MLflow run as it was: checked before it is reopened
    tracking_uri = tracking.resolve_tracking_uri(cfg.run.tracking_uri, out_dir)
    check_store(tracking_uri, tracking_uri_source(cfg.run.tracking_uri))  # read-only, corrupt, locked: named here
    for orphan in tracking.end_orphaned_runs(tracking_uri, cfg.run.experiment):  # left RUNNING by a killed process
        console.print(f"[yellow]mlflow run {orphan} was left RUNNING by a process that is gone: marked KILLED[/]")
    mlflow_run = None if restart else tracking.find_run(tracking_uri, cfg.run.experiment, "flyroll.run_id", run_id)
    tags = {"flyroll.run_id": run_id, "flyroll.config_hash": chash, "flyte.execution_id": execution_id(), "flyroll.kind": tagged_kind(cfg, kind),
            "flyroll.registered_model": cfg.run.registered_model}
    if mlflow_run is None:
        # a local SQLite store keeps its artifacts in the run folder too (MLflow's default is ./mlruns)
        artifacts = os.path.join(out_dir, "mlartifacts") if tracking_uri.startswith("sqlite:") else None
        mlflow_run = tracking.start_parent_run(tracking_uri, cfg.run.experiment, run_id, cfg.flat(), tags,
                                               artifact_location=None if artifacts is None else f"file://{artifacts}")
        tracking.log_text(tracking_uri, mlflow_run, cfg.model_dump_json(indent=2), "config.json")
        console.print(f"[bold]run[/] {run_id}  mlflow run {mlflow_run}  store {store_uri}")
    else:
        tracking.set_tags(tracking_uri, mlflow_run, {"flyte.execution_id.resumed": execution_id()})
        console.print(f"[bold]resuming run[/] {run_id}  mlflow run {mlflow_run}")
    tracking.claim_run(tracking_uri, mlflow_run, end_on_exit=is_local_execution())  # RUNNING, owned by this process
    spec = RunSpec(cfg.to_json(), chash, run_id, store_uri, tracking_uri, mlflow_run)
    return PrepareOut(spec, model_spec_of(cfg, store_uri))


def model_spec_of(cfg, store_uri: str) -> str:
    """What builds the starting policy and the reference (`build_base_policy`, `build_reference`), as
    JSON: the model section, seed, store, threads and the environment (its demonstrations)."""
    # a local model folder by its content too: one re-saved at the same path is a new import (and a new
    # Flyte cache key of bootstrap_policy, whose input this is), not the first import silently reused
    folders = {f: fingerprint(p)["digest"] for f, p in (("path", cfg.model.path), ("reference_path", cfg.model.reference_path))
               if p and os.path.isdir(p)}
    return json.dumps({"model": cfg.model.model_dump(mode="json"), "seed": cfg.run.seed, "store_uri": store_uri,
                       "threads": cfg.run.torch_threads, **({"model_fingerprints": folders} if folders else {}),
                       **({"env": cfg.env.model_dump(mode="json")} if cfg.env is not None else {})}, sort_keys=True)


def resolved_config(config: str, overrides: typing.Optional[typing.List[str]], cfg) -> str:
    """The run's first lines: the preset, the overrides, and the settings that differ from the schema's
    defaults after both (the whole resolved config is the MLflow run's params and config.json)."""
    import yaml
    from rich.markup import escape

    head = f"[bold]config[/] {escape(config or 'configs/tiny.yaml (default)')}"
    if overrides:
        head += "  --set " + escape(" ".join(overrides))
    class OneLineStrings(yaml.SafeDumper):  # a string with a line break written "\n", not folded over lines
        pass

    OneLineStrings.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style='"' if "\n" in v else None))
    body = yaml.dump(cfg.model_dump(mode="json", exclude_defaults=True), Dumper=OneLineStrings, sort_keys=True,
                     default_flow_style=None)
    return f"{head}\nresolved config (settings that differ from the defaults):\n{escape(body.rstrip())}"


def check_remote_uris(cfg, env) -> None:
    """On a Flyte cluster each task runs in its own pod, so the local defaults (`<output_dir>/store`,
    a SQLite MLflow file) would be private to one pod and lost with it: there, the artifact store and
    the tracking server must be named. A pod Flyte started has FLYTE_INTERNAL_EXECUTION_ID set (a local
    `pyflyte run` does not)."""
    if not env.get("FLYTE_INTERNAL_EXECUTION_ID"):
        return
    missing = []
    if not (cfg.run.store_uri or env.get("FLYROLL_STORE_URI")):
        missing.append("the artifact store: set run.store_uri or FLYROLL_STORE_URI (e.g. s3://bucket/flyroll)")
    if not (cfg.run.tracking_uri or env.get("MLFLOW_TRACKING_URI")):
        missing.append("the MLflow tracking server: set run.tracking_uri or MLFLOW_TRACKING_URI (e.g. http://mlflow:5000)")
    if missing:
        raise ValueError("this run executes on a Flyte cluster (FLYTE_INTERNAL_EXECUTION_ID is set), where the local "
                         "defaults would live in one pod and vanish with it; name " + "; and ".join(missing))


def check_remote_sync(cfg, env) -> None:
    """sync.method=live unfused on a Flyte cluster: each stage its own Ray cluster (per-task mode),
    refused here, before any cluster, as a local FLYROLL_RAY=per-task run is at config check."""
    if env.get("FLYTE_INTERNAL_EXECUTION_ID") and cfg.sync.method == "live" and cfg.loop.fuse == 1:
        raise ValueError("sync.method=live with loop.fuse=1 on a Flyte cluster: in per-task mode (one Ray cluster per "
                         "stage) the store is the hand-off, because the training cluster is gone when the rollout "
                         "starts; set sync.method: store, or loop.fuse > 1 (one cluster for the fused iterations)")


def _publish_table(store: ArtifactStore, df, key: str, kind: str, metadata: dict) -> None:
    if store.exists(key):
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{key.rsplit('/', 1)[-1]}.parquet")
        df.to_parquet(path, index=False)
        store.publish_file(path, key, kind=kind, producer="make_dataset", execution_id=execution_id(), metadata=metadata)


# rewritten by every save_pretrained of the same model (a trained checkpoint's differ from its base's); the
# vocabulary (tokenizer.json, vocab/merges) and the context length are what bound the prompts
_MODEL_CONFIGS = ("config.json", "generation_config.json", "tokenizer_config.json")


@task(**task_resources("dataset"))
def make_dataset(spec: RunSpec, base: PolicyRef) -> DatasetRef:
    """The train and eval prompt tables as versioned parquet artifacts (content-addressed by the data
    config, the fingerprints of the files it reads, and the policy, whose tokenizer and context bound
    the prompts). Bad rows of user files are skipped, prompts over data.max_prompt_tokens dropped or
    truncated; counts and reasons go to MLflow. A domain no reward can score (reward.functions,
    metadata.reward_fn, the domain's name) is refused here, before any cluster starts."""
    cfg = config_of(spec)
    d = cfg.data.model_dump(mode="json")
    store = store_of(spec)
    # the policy's part of the key: its vocabulary files and its context (what bounds the prompts), not its
    # config files, which a trained checkpoint of the same model rewrites (a retrain from the champion must
    # find the dataset its first run built, or recorded scores would not compare)
    tokenizer_files = sorted((rel, e.sha256) for rel, e in store.manifest(base.key).files.items()
                             if not rel.startswith(NOT_TOKENIZER) and rel not in _MODEL_CONFIGS)
    # what the files hold, not only their names: appended rows (or a re-uploaded object) make a new version;
    # data without files keeps the key it had before fingerprints existed
    inputs = data_fingerprints(cfg.data.sources)
    identity = [d, cfg.run.seed, tokenizer_files, context_of(store, base), cfg.rollout.max_new_tokens, cfg.model.apply_chat_template]
    if inputs:
        identity.append({u: f["digest"] for u, f in inputs.items()})
    version = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    name = "synthetic" if not cfg.data.sources else "mixed"
    keys = {s: f"datasets/{name}-{version}/{s}" for s in ("train", "eval")}
    if not all(store.exists(k) for k in keys.values()):
        eval_notes: list[str] = []
        long_lines: list = []   # (file, LongLines): lines over data.max_line_bytes, dropped unread
        min_train = cfg.rollout.prompts_per_iteration if cfg.rollout.partial_rollout_max_split == 1 else 1
        train, evals, problems = build_splits(d, cfg.run.seed, min_train, eval_notes, long_lines)
        train, evals, bounds = bounded_splits(cfg, store, base, train, evals)
        long_rows = [r.summary(split) for split, r in bounds.items() if r.over]
        long_line_rows = [f"{uri}: {r.summary()}" for uri, r in long_lines]
        for split, df in (("train", train), ("eval", evals)):
            if not len(df):
                raise ValueError(f"data: no {split} prompt is left ({'; '.join(long_rows) or 'the sources gave none'})")
            mix = df["domain"].value_counts(normalize=True).round(4).to_dict()
            _publish_table(store, encode_nested(df), keys[split], "dataset",
                           {"split": split, "rows": len(df), "domains": mix, "skipped_rows": problems,
                            "domain_rows": {str(k): int(v) for k, v in df["domain"].value_counts().items()},
                            "max_prompt_tokens": bounds[split].limit, "long_prompts": bounds[split].over,
                            "over_length": cfg.data.over_length, "long_prompts_report": bounds[split].summary(split),
                            "long_lines": sum(r.count for _, r in long_lines), "long_lines_report": long_line_rows,
                            "inputs": inputs, "eval_split_notes": eval_notes})
        for note in eval_notes:
            console.print(f"[yellow]eval split:[/] {note}")
        if problems:
            console.print("[yellow]skipped bad rows:[/] " + " | ".join(problems))
            tracking.log_text(spec.tracking_uri, spec.mlflow_run_id, "\n".join(problems), "data/skipped_rows.txt")
        if long_rows:
            console.print("[yellow]long prompts:[/] " + " | ".join(long_rows))
        if long_line_rows:
            console.print("[yellow]long lines:[/] " + " | ".join(long_line_rows))
    for split, key in keys.items():   # a domain no reward can score is refused before any cluster starts
        rows = decode_nested(read_table(spec, key))
        meta = rows["metadata"] if "metadata" in rows.columns else [None] * len(rows)
        check_routes([(d, {"metadata": m}) for d, m in zip(rows["domain"], meta)], cfg.reward, f"data ({split} split {key})")
    manifest = store.manifest(keys["train"])
    eval_meta = store.manifest(keys["eval"]).metadata
    console.print(f"dataset {name}-{version}: {manifest.metadata.get('rows')} train / {eval_meta.get('rows')} eval prompts "
                  f"(train by domain {manifest.metadata.get('domain_rows')})")
    if "domain_rows" in manifest.metadata:
        check_train_split(cfg, manifest.metadata["domain_rows"])
    long_key = "data/dropped_long_prompts" if cfg.data.over_length == "drop" else "data/truncated_prompts"
    tracking.log_metrics(spec.tracking_uri, spec.mlflow_run_id,
                         {"data/train_rows": float(manifest.metadata["rows"]),
                          long_key: float(manifest.metadata.get("long_prompts", 0)),
                          "data/dropped_long_lines": float(manifest.metadata.get("long_lines", 0)),
                          "data/skipped_row_reports": float(len(manifest.metadata.get("skipped_rows", [])))}, step=0)
    before = tracking.client(spec.tracking_uri).get_run(spec.mlflow_run_id).data.tags.get("flyroll.dataset.train")
    if before and before != keys["train"]:  # a resumed run whose data files changed since it started
        console.print(f"[yellow]data changed since this run started:[/] its earlier iterations trained on {before}, the "
                      f"iterations from here on use {keys['train']} (tag flyroll.dataset.train.previous); start a new run "
                      "(a changed run.name or --set) to keep one dataset per run")
        tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.dataset.train.previous": before})
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.dataset.train": keys["train"], "flyroll.dataset.eval": keys["eval"],
                                                              **({"flyroll.dataset.inputs": json.dumps({u: f["digest"] for u, f in inputs.items()})}
                                                                 if inputs else {})})
    for split, key in keys.items():  # MLflow dataset inputs: the run page's Datasets, the Runs table's dataset column
        meta = manifest.metadata if split == "train" else eval_meta
        tracking.log_dataset(spec.tracking_uri, spec.mlflow_run_id, name=f"{name}/{split}", digest=version,
                             source=store.uri(key), context=split,
                             profile={"rows": meta.get("rows"), "domains": meta.get("domain_rows")})
    return DatasetRef(train_key=keys["train"], eval_key=keys["eval"])


@task(cache=Cache(version="1", serialize=True), **task_resources("bootstrap"))
def bootstrap_policy(model_spec: str) -> PolicyRef:
    return build_base_policy(model_spec)


def build_base_policy(model_spec: str) -> PolicyRef:
    """The starting policy. With `model.path` unset: build a tiny Qwen2 + char tokenizer offline and
    pre-train it on the bundled tasks (cached by Flyte and by the store key); with a local model
    directory: import it into the store; with a store key: use it as is. An agentic run with
    `model.warm_start.steps` then fine-tunes the imported model on the environment's solver episodes
    (`warm_start`)."""
    spec = json.loads(model_spec)
    m = spec["model"]
    store = ArtifactStore(spec["store_uri"])
    path = m["path"]
    digest = hashlib.sha256(model_spec.encode()).hexdigest()[:12]
    if path:
        key = imported_policy(spec, store, digest)
        if spec.get("env") and m.get("warm_start", {}).get("steps", 0) > 0:
            with _memory_handed_back():
                return warm_start(spec, store, key, digest)
        return PolicyRef(key=key, version=0)
    key = f"models/tiny-{digest}/v0000"
    if store.exists(key):
        console.print(f"[bold]bootstrap[/] reusing {key}")
        return PolicyRef(key=key, version=0)
    with _memory_handed_back():
        return _bootstrap_tiny(spec, store, key)


@contextlib.contextmanager
def _memory_handed_back():
    """Around a fine-tune in this process (a local run's driver, which goes on to drive the whole
    loop): its model, AdamW state and activations are freed after it, and the heap's free pages are
    handed back. Without it the driver of a SmolLM2 warm start kept ~9 GB for the rest of the run."""
    try:
        yield
    finally:
        gc.collect()   # the model's reference cycles
        release_allocator_caches()


def _bootstrap_tiny(spec: dict, store: ArtifactStore, key: str) -> PolicyRef:
    """The tiny Qwen2 + char tokenizer built offline and pre-trained (model.bootstrap), published as `key`."""
    m = spec["model"]
    from engines.models.modeling import build_tiny_policy, save_policy  # engines.models.modeling: here and below, not at the top: it
                                                                 # loads transformers' model classes (~5 s of import)
    b = m["bootstrap"]
    # one thread for the tiny model: its ops are too small to split, and beside another job a second thread costs
    # more than it gives (engines/models/threads.py `model_threads`; a user's OMP_NUM_THREADS decides instead)
    torch.set_num_threads(capped_threads(model_threads(os.cpu_count() or 1, b["hidden_size"])))
    model, tok = build_tiny_policy(b["hidden_size"], b["num_layers"], b["num_heads"], max_positions=b["max_positions"], seed=spec["seed"])
    if spec.get("env"):  # agentic: pre-train on scripted-solver episodes of the environment
        pairs = env_demonstrations(spec)
    else:
        rng = random.Random(spec["seed"])
        problems = make_problems("bootstrap", b["num_examples"], seed=spec["seed"])
        pairs = [(p.prompt, teacher_demonstration(p, rng, b["teacher_accuracy"])) for p in problems]
    metrics = _finetune(model, tok, pairs, "bootstrap pre-training", steps=b["steps"], batch_size=b["batch_size"], lr=b["lr"],
                        seed=spec["seed"])
    with tempfile.TemporaryDirectory() as d:
        save_policy(model, tok, d)
        store.publish(d, key, kind="checkpoint", producer="bootstrap_policy", execution_id=execution_id(),
                      metadata={"bootstrap": b, "seed": spec["seed"], **metrics})
    console.print(f"[bold]bootstrap[/] published {key} ({metrics['bootstrap/seconds']:.0f}s, loss {metrics['bootstrap/loss']:.3f})")
    return PolicyRef(key=key, version=0)


def env_demonstrations(spec: dict, fmt=None) -> list:
    """The environment's scripted-solver episodes (env.bootstrap_episodes seeds from BOOTSTRAP_ENV_SEED0, the
    env.bootstrap_* teacher settings) as (prompt, response) pairs laid out as the episodes will be,
    framed by `fmt` (engines/agentic/env_manager.py ChatFormat) when given: the tiny policy's bootstrap and a
    model's warm start train on them."""
    env = spec["env"]
    pairs = solved_episodes(env["name"], [BOOTSTRAP_ENV_SEED0 + i for i in range(env["bootstrap_episodes"])],
                            max_turns=env["max_turns"], env_kwargs=env["kwargs"],
                            habit_rate=env.get("bootstrap_habit_rate", 0.0), habit_seed=spec["seed"],
                            detour_rate=env.get("bootstrap_detour_rate", 0.0), segments=env.get("bootstrap_loss") == "actions",
                            random_ties=env.get("bootstrap_random_ties", False), fmt=fmt)
    if not pairs:
        raise ValueError(f"env {env['name']!r}: the scripted solver finished none of {env['bootstrap_episodes']} bootstrap "
                         f"episodes within env.max_turns={env['max_turns']}; raise env.max_turns")
    return pairs


def _finetune(model, tok, pairs: list, label: str, **kwargs) -> dict[str, float]:
    """engines/training/pretrain.py `supervised_finetune` with a progress bar (step, loss, time left). Where the
    console is not a terminal (a pod's log, a file), rich draws no live bar, so one line is printed
    every `_LOG_EVERY_S` seconds and at the last step instead."""
    if not console.is_terminal:
        return supervised_finetune(model, tok, pairs, on_step=_progress_lines(label, kwargs["steps"]), **kwargs)
    with Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
                  TimeRemainingColumn(), console=console) as progress:
        bar = progress.add_task("sft", total=kwargs["steps"], loss=float("nan"))
        return supervised_finetune(model, tok, pairs, on_step=lambda s, loss: progress.update(bar, completed=s + 1, loss=loss),
                                   **kwargs)


_LOG_EVERY_S = 30.0


def _progress_lines(label: str, total: int):
    """An `on_step(step, loss)` that prints `label step/total loss, elapsed, time left` at most every
    `_LOG_EVERY_S` seconds, and always at the first and the last step."""
    t0 = time.monotonic()
    last = [float("-inf")]

    def on_step(step: int, loss: float) -> None:
        now, done = time.monotonic(), step + 1
        if done in (1, total) or now - last[0] >= _LOG_EVERY_S:
            last[0] = now
            elapsed = now - t0
            left = elapsed / done * (total - done)
            console.print(f"{label} {done}/{total} loss {loss:.3f} ({elapsed:.0f} s, ~{left:.0f} s left)")
    return on_step


def warm_start(spec: dict, store: ArtifactStore, source: str, digest: str) -> PolicyRef:
    """`model.warm_start`: the model at store key `source` fine-tuned on the environment's solver
    episodes (`env_demonstrations`, in the chat format when model.apply_chat_template), published as
    models/warm-<digest>/v0000 with `source` as parent; reused when already there."""
    from engines.agentic.env_manager import ChatFormat
    from engines.models.modeling import load_policy, save_policy

    key = f"models/warm-{digest}/v0000"
    if store.exists(key):
        console.print(f"[bold]warm start[/] reusing {key}")
        return PolicyRef(key=key, version=0)
    w = spec["model"]["warm_start"]
    torch.set_num_threads(capped_threads(spec.get("threads") or os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as d:
        model, tok = load_policy(store.fetch(source, os.path.join(d, "source")))
        pairs = env_demonstrations(spec, ChatFormat.of(tok) if spec["model"]["apply_chat_template"] else None)
        metrics = _finetune(model, tok, pairs, "warm start", steps=w["steps"], batch_size=w["batch_size"], lr=w["lr"],
                            seed=spec["seed"])
        save_policy(model, tok, os.path.join(d, "out"))
        store.publish(os.path.join(d, "out"), key, kind="checkpoint", producer="bootstrap_policy", parents=[source],
                      execution_id=execution_id(),
                      metadata={"warm_start": w, "warm_started_from": source, "demonstrations": len(pairs), **metrics})
    console.print(f"[bold]warm start[/] published {key} from {source} ({len(pairs)} demonstrations, "
                  f"{metrics['bootstrap/seconds']:.0f}s, loss {metrics['bootstrap/loss']:.3f})")
    return PolicyRef(key=key, version=0)


@task(**task_resources("setup"))
def reference_policy(spec: RunSpec, model_spec: str, base: PolicyRef) -> PolicyRef:
    """The reference model of the KL term (`build_reference`), tagged on the MLflow run as
    `flyroll.reference`. Runs before the loop, so a wrong reference fails before any Ray cluster."""
    ref = build_reference(model_spec, base)
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.reference": ref.key})
    return ref


def verify_resume_policy(store: ArtifactStore, run_id: str) -> None:
    """Re-hash the newest published policy version of run `run_id` -- the one its rerun resumes from; for
    a finished run, its final policy -- against its manifest: a corrupt one raises `CorruptArtifact`
    naming it and the earlier version to go back to. `prepare_run` calls it before it opens or reopens
    the MLflow run, so a refused rerun leaves that run as it was (a FINISHED run stays FINISHED, its tags
    unchanged), and `resume_point` then starts from a verified version."""
    versions = store.list(policy_prefix(run_id))
    if not versions:
        return
    try:
        store.verify(versions[-1])  # every file re-hashed: a corrupt version is never resumed from
    except CorruptArtifact as e:
        raise CorruptArtifact(f"run {run_id!r} is not resumed: its newest policy version {versions[-1]} is corrupt; its "
                              f"MLflow run is left as it was (not reopened). {e}") from e


@task(**task_resources("setup"))
def resume_point(spec: RunSpec, base: PolicyRef, model_spec: str) -> PolicyRef:
    """Where the loop starts: the last published policy of this run (resume), else the base policy.
    `prepare_run` has re-hashed that version against its manifest (`verify_resume_policy`), before
    it reopened the MLflow run.

    A cached `bootstrap_policy` output can outlive its artifact (someone deleted the store folder):
    then the base is rebuilt here, so a cache hit never hands the loop a missing checkpoint."""
    if not store_of(spec).exists(base.key):
        console.print(f"[yellow]base policy {base.key} is missing from the store (cached output of a deleted store); rebuilding[/]")
        rebuilt = build_base_policy(model_spec)
        if rebuilt.key != base.key:
            raise ValueError(f"rebuilt base policy {rebuilt.key} differs from the cached {base.key}")
    versions = store_of(spec).list(policy_prefix(spec.run_id))
    if not versions:
        return base
    key = versions[-1]
    version = parse_policy_key(key).version
    manifest = store_of(spec).manifest(key)  # its files: re-hashed by prepare_run (verify_resume_policy)
    console.print(f"[bold]resume[/] from {key} (iteration {version}, hashes verified)")
    if owed := settle_published_iteration(spec, key):  # killed after its publish, before its metrics
        console.print(f"[yellow]iteration {version}'s weight sync was cut short after its publish: logged {sorted(owed)}[/]")
    return PolicyRef(key=key, version=version, model_version=manifest.metadata.get("model_version", ""))


LoopBounds = typing.NamedTuple("LoopBounds", [("last", int), ("eval_every", int)])


@task(**task_resources("controller"))
def loop_bounds(spec: RunSpec) -> LoopBounds:
    """The last iteration and the eval cadence, from the config."""
    cfg = config_of(spec)
    return LoopBounds(cfg.loop.iterations, cfg.loop.eval_every)
