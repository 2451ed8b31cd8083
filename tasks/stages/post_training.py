# longer than 400 lines: the post-training kinds' set-up and training tasks (dataset, schedule, on-policy pairs, teacher, top-k)
"""SFT, DPO and distillation as tasks in the RL run's shape (workflows/sft.py, dpo.py, distill.py): the
versioned demonstration or pair tables (`make_post_dataset`), the schedule of optimizer steps
(`post_bounds`, `step_rows`), DPO's on-policy pairs (`best_worst_pairs`), the distillation teacher and
its stored top-k (`teacher_policy`, `teacher_topk`), and the training task that runs a version's steps
in the training actors (tasks/actors/train.py `post_train`) and writes its checkpoint, which
tasks/stages/weight_sync.py `publish_weights` publishes as the run's next policy version.

The step schedule is a stream over the train rows, a fresh order per epoch (seed + epoch): step s
takes rows s·B .. (s+1)·B of it, so version v (steps (v−1)·S .. v·S − 1, S = steps_per_version) is
the same rows whether it runs in one execution or after a resume.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tempfile
import typing

import pandas as pd
import ray
from flytekit import task
from flytekit.types.directory import FlyteDirectory

from engines.data.fingerprint import fingerprint
from engines.data.prompt_mix import hash_split
from engines.data.tuning_rows import load_rows
from engines.rewards.routing import check_routes
from infra import tracking
from infra.ray_cluster import ray_job
from infra.resources import task_resources
from tasks.actors.hybrid import role_actors, train_workers
from tasks.loop.prompts import read_table
from tasks.run.checkpoints import scratch_checkpoint_dir
from tasks.run.common import config_of, console, execution_id, stage, store_of
from tasks.run.keys import policy_key
from tasks.run.splits import NOT_TOKENIZER, context_of
from tasks.run.types import DatasetRef, PolicyRef, RunSpec
from configs.checks import kind_of
_MODEL_CONFIGS = ("config.json", "generation_config.json", "tokenizer_config.json")


def section(cfg):
    """The config's sft, dpo or distill section."""
    return getattr(cfg, kind_of(cfg))


def _tokenizer(store, key: str):
    from engines.models.modeling import context_length, load_tokenizer  # transformers (~5 s)

    with tempfile.TemporaryDirectory() as d:
        model_dir = store.fetch(key, d, skip=NOT_TOKENIZER)
        return load_tokenizer(model_dir), context_length(model_dir)


def encode_rows(df: pd.DataFrame, tokenizer, kind: str, chat: bool, prompt_loss: bool = False) -> list:
    """Each row's Encoded (sft) or (chosen, rejected) pair of them (dpo), engines/training/supervised.py."""
    from engines.training.supervised import encode_demonstration, encode_pair

    out = []
    for _, row in df.iterrows():
        msgs = json.loads(row["prompt_messages"]) if isinstance(row.get("prompt_messages"), str) else None
        if kind != "dpo":
            out.append(encode_demonstration(tokenizer, row["prompt"], msgs, row["response"], chat=chat, prompt_loss=prompt_loss))
        else:
            out.append(encode_pair(tokenizer, row["prompt"], msgs, row["chosen"], row["rejected"], chat=chat))
    return out


def _length(e) -> int:
    return max(x.length for x in e) if isinstance(e, tuple) else e.length


def bound_rows(df: pd.DataFrame, lengths: list[int], limit: int, over_length: str, field: str, split: str,
               uri: str) -> tuple[pd.DataFrame, list[str]]:
    """The rows of at most `limit` tokens, and a report per longer row; `over_length` "refuse" raises
    instead, naming every long row (its place in the split and its prompt's start)."""
    long = [f"{split} row {i + 1} ({n} tokens, prompt {str(df.iloc[i]['prompt'])[:40]!r})"
            for i, n in enumerate(lengths) if n > limit]
    if long and over_length == "refuse":
        raise ValueError(f"{field}: {len(long)} example(s) of {uri!r} are longer than {limit} tokens (prompt + response, "
                         f"the model's tokens): {'; '.join(long[:10])}{' ...' if len(long) > 10 else ''}; raise "
                         f"{field.split('.')[0]}.max_tokens, or set {field.split('.')[0]}.over_length: drop")
    keep = [n <= limit for n in lengths]
    return df[keep].reset_index(drop=True), long


def _publish_table(store, df: pd.DataFrame, key: str, metadata: dict, parents: list[str]) -> None:
    if store.exists(key):
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{key.rsplit('/', 1)[-1]}.parquet")
        df.to_parquet(path, index=False)
        store.publish_file(path, key, kind="dataset", producer="make_post_dataset", parents=parents,
                           execution_id=execution_id(), metadata=metadata)


def folder_of(dataset: DatasetRef) -> str:
    """datasets/<kind>-<version>: where the train and eval tables of an SFT or DPO dataset live."""
    return dataset.train_key.rsplit("/", 1)[0]


@task(**task_resources("dataset"))
def make_post_dataset(spec: RunSpec, base: PolicyRef) -> DatasetRef:
    """The demonstration (SFT) or preference (DPO) train and eval tables as versioned parquet
    artifacts, content-addressed by the section's data settings, the files' fingerprints and the
    policy's tokenizer and context (which bound the examples). Bad rows are skipped and reported
    (MLflow data/skipped_rows.txt), long ones dropped or refused (`over_length`). Eval rows that carry
    an `answer` also make an eval prompt table (`eval_prompts`), scored with the run's rewards; a
    domain no reward scores is refused here, before any cluster starts. The returned DatasetRef's
    `eval_key` is that prompt table when there is one, else the eval table."""
    cfg = config_of(spec)
    kind, sec = kind_of(cfg), section(cfg)
    store = store_of(spec)
    field = f"{kind}.train_uri"
    tokenizer_files = sorted((rel, e.sha256) for rel, e in store.manifest(base.key).files.items()
                             if not rel.startswith(NOT_TOKENIZER) and rel not in _MODEL_CONFIGS)
    inputs = {u: fingerprint(u) for u in (sec.train_uri, sec.eval_uri) if u}   # what the files hold, not only their names
    data = sec.model_dump(mode="json", include={"train_uri", "eval_uri", "eval_size", "max_tokens", "over_length", "prompt_loss"})
    identity = [kind, data, cfg.run.seed, tokenizer_files, context_of(store, base), cfg.model.apply_chat_template,
                cfg.data.max_line_bytes, {u: f["digest"] for u, f in inputs.items()}]
    version = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    folder = f"datasets/{kind}-{version}"
    keys = {s: f"{folder}/{s}" for s in ("train", "eval", "eval_prompts")}
    row_kind = "preference" if kind == "dpo" else "sft"
    if not (store.exists(keys["train"]) and store.exists(keys["eval"])):
        res = load_rows(sec.train_uri, row_kind, max_line_bytes=cfg.data.max_line_bytes)
        reports = [res.summary()] if res.errors or res.notes or (res.long_lines and res.long_lines.count) else []
        if sec.eval_uri:
            ev = load_rows(sec.eval_uri, row_kind, max_line_bytes=cfg.data.max_line_bytes)
            reports += [ev.summary()] if ev.errors or ev.notes or (ev.long_lines and ev.long_lines.count) else []
            train, evals = res.table, ev.table.head(sec.eval_size)
        else:
            split = hash_split(res.table, sec.eval_size, what=f"{field} {sec.train_uri!r}")
            if split.note:
                console.print(f"[yellow]eval split:[/] {split.note}")
            train, evals = split.train, split.evals
        tokenizer, context = _tokenizer(store, base.key)
        limit = min(sec.max_tokens, context) if context else sec.max_tokens
        prompt_loss = getattr(sec, "prompt_loss", False)
        bounded, long_rows = {}, []
        for name, df, uri in (("train", train, sec.train_uri), ("eval", evals, sec.eval_uri or sec.train_uri)):
            lengths = [_length(e) for e in encode_rows(df, tokenizer, kind, cfg.model.apply_chat_template, prompt_loss)]
            bounded[name], long = bound_rows(df, lengths, limit, sec.over_length, f"{kind}.max_tokens", name, uri)
            long_rows += long
            if not len(bounded[name]):
                raise ValueError(f"{field}: no {name} example is left ({len(long)} longer than {limit} tokens); raise "
                                 f"{kind}.max_tokens or give shorter examples")
        if reports:
            console.print("[yellow]skipped bad rows:[/] " + " | ".join(reports))
            tracking.log_text(spec.tracking_uri, spec.mlflow_run_id, "\n".join(reports), "data/skipped_rows.txt")
        if long_rows:
            console.print(f"[yellow]dropped {len(long_rows)} example(s) over {limit} tokens:[/] " + "; ".join(long_rows[:5]))
            tracking.log_text(spec.tracking_uri, spec.mlflow_run_id, "\n".join(long_rows), "data/dropped_long_examples.txt")
        meta = {"kind": kind, "inputs": inputs, "skipped_rows": reports, "long_examples": len(long_rows), "max_tokens": limit}
        answered = bounded["eval"][bounded["eval"]["answer"].notna()]
        if len(answered):
            prompts = pd.DataFrame({"prompt_id": [f"eval-{i}" for i in range(len(answered))], "domain": answered["domain"].tolist(),
                                    "prompt": answered["prompt"].tolist(), "answer": answered["answer"].tolist(),
                                    "tests": [None] * len(answered), "metadata": answered["metadata"].tolist()})
            if answered["prompt_messages"].notna().any():
                prompts = prompts[answered["prompt_messages"].isna().tolist()]   # a conversation is not one prompt
            if len(prompts):
                _publish_table(store, prompts.reset_index(drop=True), keys["eval_prompts"],
                               {**meta, "split": "eval_prompts", "rows": len(prompts)}, [])
        for name in ("train", "eval"):
            _publish_table(store, bounded[name], keys[name], {**meta, "split": name, "rows": len(bounded[name])}, [])
    eval_key = keys["eval_prompts"] if store.exists(keys["eval_prompts"]) else keys["eval"]
    if eval_key == keys["eval_prompts"]:   # their rewards must exist before any cluster starts
        rows = read_table(spec, eval_key)
        check_routes([(d, {"metadata": json.loads(m) if isinstance(m, str) else m}) for d, m in zip(rows["domain"], rows["metadata"])],
                     cfg.reward, f"{kind} eval rows with an answer ({eval_key})")
    train_meta, eval_meta = store.manifest(keys["train"]).metadata, store.manifest(keys["eval"]).metadata
    console.print(f"dataset {kind}-{version}: {train_meta['rows']} train / {eval_meta['rows']} eval "
                  f"{'pairs' if kind == 'dpo' else 'demonstrations'}"
                  + (" (+ eval prompts scored by the rewards)" if eval_key == keys["eval_prompts"] else ""))
    tracking.log_metrics(spec.tracking_uri, spec.mlflow_run_id,
                         {"data/train_rows": float(train_meta["rows"]), "data/eval_rows": float(eval_meta["rows"]),
                          "data/dropped_long_examples": float(train_meta.get("long_examples", 0)),
                          "data/skipped_row_reports": float(len(train_meta.get("skipped_rows", [])))}, step=0)
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.dataset.train": keys["train"],
                                                              "flyroll.dataset.eval": keys["eval"]})
    for split, key, meta in (("train", keys["train"], train_meta), ("eval", keys["eval"], eval_meta)):
        tracking.log_dataset(spec.tracking_uri, spec.mlflow_run_id, name=f"{kind}/{split}", digest=version,
                             source=store.uri(key), context=split, profile={"rows": meta.get("rows")})
    return DatasetRef(train_key=keys["train"], eval_key=eval_key)


def total_steps(sec, rows: int) -> int:
    """The run's optimizer steps: `steps`, else epochs × ceil(rows / batch_size)."""
    return sec.steps or sec.epochs * math.ceil(rows / sec.batch_size)


def step_rows(rows: int, batch_size: int, seed: int, first: int, count: int) -> list[list[int]]:
    """Rows of steps first .. first+count−1 of the stream (a fresh order of range(rows) per epoch)."""
    start, end = first * batch_size, (first + count) * batch_size
    stream: list[int] = []
    epoch = start // rows
    skip = start - epoch * rows
    while len(stream) < end - start + skip:
        order = list(range(rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        stream += order
        epoch += 1
    stream = stream[skip:skip + end - start]
    return [stream[i:i + batch_size] for i in range(0, len(stream), batch_size)]


PostBounds = typing.NamedTuple("PostBounds", [("last", int), ("eval_every", int), ("rewards", bool)])


@task(**task_resources("controller"))
def post_bounds(spec: RunSpec, dataset: DatasetRef) -> PostBounds:
    """The last version (ceil(total steps / steps_per_version)), the reward-eval cadence, and whether
    the eval rows give a reward-scored eval split."""
    cfg = config_of(spec)
    sec = section(cfg)
    rows = store_of(spec).manifest(dataset.train_key).metadata["rows"]
    last = math.ceil(total_steps(sec, rows) / sec.steps_per_version)
    return PostBounds(last, getattr(sec, "eval_every", 0), dataset.eval_key.endswith("/eval_prompts"))


def best_worst_pairs(samples: pd.DataFrame) -> tuple[list, dict[str, float]]:
    """DPO's on-policy pairs from a scored rollout table: for every group (`group_id`) whose rewards
    differ, its best response chosen and its worst rejected (the first of equals), tokens as sampled
    (engines/training/supervised.py `Encoded`); and the counts (`dpo/pairs`, `dpo/groups_without_preference`,
    `dpo/reward_gap`: the mean best − worst reward of the pairs)."""
    from engines.training.supervised import Encoded

    pairs, gaps, flat = [], [], 0
    for _, group in samples.groupby("group_id", sort=True):
        rewards = group["reward"].astype(float).tolist()
        best, worst = max(range(len(rewards)), key=rewards.__getitem__), min(range(len(rewards)), key=rewards.__getitem__)
        if rewards[best] == rewards[worst]:
            flat += 1
            continue
        rows = group.iloc[[best, worst]]
        prompt = [int(t) for t in rows.iloc[0]["prompt_token_ids"]]
        chosen, rejected = ([int(t) for t in r] for r in rows["response_token_ids"])
        pairs.append((Encoded(prompt, chosen, [1] * len(chosen)), Encoded(prompt, rejected, [1] * len(rejected))))
        gaps.append(rewards[best] - rewards[worst])
    return pairs, {"dpo/pairs": float(len(pairs)), "dpo/groups_without_preference": float(flat),
                   "dpo/reward_gap": sum(gaps) / len(gaps) if gaps else 0.0}


@task(task_config=ray_job("training"), **task_resources("training"))
def post_train(spec: RunSpec, policy: PolicyRef, reference: PolicyRef, dataset: DatasetRef, version: int,
               samples: typing.Optional[pd.DataFrame] = None) -> FlyteDirectory:
    """Version `version`'s optimizer steps (SFT, DPO or distillation, by the config's section) from
    `policy` in the training actors, the eval split's loss, and the checkpoint (published by
    `publish_weights`). DPO: the reference's log-probs of this version's pairs and of the eval pairs
    come from the reference actor (`reference`: model.reference_path, else the starting policy); with
    `samples` (dpo.pairs=on_policy: this round's scored rollout table) the pairs are its groups' best
    and worst responses (`best_worst_pairs`), trained dpo.epochs passes. Distillation: `reference` is
    the teacher, whose top-k `teacher_topk` stored."""
    cfg = config_of(spec)
    kind, sec = kind_of(cfg), section(cfg)
    metrics: dict[str, float] = {}
    if samples is not None:
        return _on_policy_round(spec, cfg, policy, reference, samples, version, metrics)
    with stage(spec, "training", version, metrics):
        store = store_of(spec)
        folder = folder_of(dataset)
        train, evals = read_table(spec, f"{folder}/train"), read_table(spec, f"{folder}/eval")
        tokenizer, _ = _tokenizer(store, policy.key)
        total = total_steps(sec, len(train))
        first = (version - 1) * sec.steps_per_version
        count = min(sec.steps_per_version, total - first)
        if count < 1:
            raise ValueError(f"version {version} has no step: the run has {total} steps of {sec.steps_per_version} per version")
        steps = step_rows(len(train), sec.batch_size, cfg.run.seed, first, count)
        used = sorted({j for s in steps for j in s})
        at = {j: i for i, j in enumerate(used)}
        chat = cfg.model.apply_chat_template
        prompt_loss = getattr(sec, "prompt_loss", False)
        examples = encode_rows(train.iloc[used], tokenizer, kind, chat, prompt_loss)
        eval_examples = encode_rows(evals, tokenizer, kind, chat, prompt_loss)
        local_steps = [[at[j] for j in s] for s in steps]
        settings, reference_lp = {}, None
        if kind == "dpo":
            settings = {"loss": sec.loss, "beta": sec.beta, "label_smoothing": sec.label_smoothing}
            reference_lp = _reference_logprobs(spec, cfg, reference, tokenizer, {"train": examples, "eval": eval_examples})
        elif kind == "distill":   # the teacher's top-k of these rows, from the artifact `teacher_topk` wrote
            settings = {"divergence": sec.divergence, "divergence_weight": sec.divergence_weight,
                        "student_temperature": sec.student_temperature, "teacher_temperature": sec.teacher_temperature,
                        "options": sec.divergence_options(), "top_k": min(sec.top_k, len(tokenizer))}
            topk = {split: read_topk(store, topk_key(dataset, reference, sec.top_k, split)) for split in ("train", "eval")}
            reference_lp = {"train": [topk["train"][j] for j in used], "eval": topk["eval"]}
        out = _train_version(spec, cfg, kind, policy, version, total, examples, local_steps, settings, eval_examples,
                             reference_lp, metrics)
        metrics.update({f"{kind}/steps_done": float(first + count), f"{kind}/epoch": (first + count) * sec.batch_size / len(train)})
    return FlyteDirectory(out)


def _train_version(spec: RunSpec, cfg, kind: str, policy: PolicyRef, version: int, total: int | None, examples: list,
                   steps: list[list[int]], settings: dict, eval_examples: list, reference_lp, metrics: dict) -> str:
    """The training actors load `policy` (LR schedule over `total` steps, None = constant after the
    warmup), run `steps` and write the checkpoint into a scratch folder, whose path is returned."""
    workers = train_workers(cfg, spec.run_id)
    ray.get([w.load.remote(spec, policy.key, cfg.training, None, total) for w in workers])
    out = scratch_checkpoint_dir(version)  # removed by publish_weights
    here = (ray.get_runtime_context().get_node_id(), out)
    (step_metrics, files), *_ = ray.get([
        w.post_train.remote(kind, examples, steps, settings, cfg.training, cfg.run.seed * 7919 + version,
                            policy_key(spec, version), here, eval_examples, reference_lp) for w in workers])
    for rel, data in files.items():
        path = os.path.join(out, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    metrics.update(step_metrics)
    metrics["training/workers"] = float(len(workers))
    return out


def _on_policy_round(spec: RunSpec, cfg, policy: PolicyRef, reference: PolicyRef, samples: pd.DataFrame, version: int,
                     metrics: dict) -> FlyteDirectory:
    """dpo.pairs=on_policy: round `version`'s pairs from its scored samples, `dpo.epochs` shuffled passes
    of `dpo.batch_size` pairs a step, then the checkpoint. A round without a pair (every group's rewards
    equal) is refused: nothing would be learned, and the message says what to change."""
    sec = cfg.dpo
    with stage(spec, "training", version, metrics):
        pairs, counts = best_worst_pairs(samples)
        metrics.update(counts)
        if not pairs:
            raise ValueError(f"dpo round {version}: none of the {int(counts['dpo/groups_without_preference'])} groups has "
                             "responses with different rewards, so there is no pair to learn from; raise "
                             "rollout.samples_per_prompt or rollout.temperature, or use easier prompts")
        steps = step_rows(len(pairs), sec.batch_size, cfg.run.seed + version, 0, sec.epochs * math.ceil(len(pairs) / sec.batch_size))
        tokenizer, _ = _tokenizer(store_of(spec), policy.key)
        settings = {"loss": sec.loss, "beta": sec.beta, "label_smoothing": sec.label_smoothing}
        reference_lp = _reference_logprobs(spec, cfg, reference, tokenizer, {"train": pairs})
        out = _train_version(spec, cfg, "dpo", policy, version, None, pairs, steps, settings, [], reference_lp, metrics)
        metrics["dpo/steps_done"] = float(len(steps))
    return FlyteDirectory(out)


def _reference_logprobs(spec: RunSpec, cfg, reference: PolicyRef, tokenizer, pairs: dict[str, list]) -> dict:
    """{split: (summed, token-mean) reference log-probs of every chosen and rejected row} from the
    reference actor."""
    from engines.training.supervised import pair_batch

    (worker,) = role_actors(cfg, spec.run_id, "reference")
    ray.get(worker.load.remote("reference", spec, reference.key))
    cap = cfg.training.max_tokens_per_micro_batch
    return {split: ray.get(worker.sequence_logprobs.remote("reference", pair_batch(p, tokenizer.pad_token_id), cap))
            for split, p in pairs.items() if p}


# --- distillation: the teacher and its top-k artifact ---------------------------------------------
@task(**task_resources("setup"))
def teacher_policy(spec: RunSpec, base: PolicyRef) -> PolicyRef:
    """`distill.teacher` imported into the store (a folder, GGUF or package; a store key as is) after the
    vocabulary check against the student (`base`), before any cluster starts; tagged on the MLflow run
    as `flyroll.teacher`. A student with more weight bytes than its teacher is warned about."""
    from tasks.run.model_import import build_reference

    cfg = config_of(spec)
    teacher = cfg.distill.teacher
    folders = {"teacher": fingerprint(teacher)["digest"]} if os.path.isdir(teacher) else {}
    model_spec = json.dumps({"model": cfg.model.model_dump(mode="json"), "store_uri": spec.store_uri, "teacher": teacher,
                             "model_fingerprints": folders})
    ref = build_reference(model_spec, base, role="teacher")
    store = store_of(spec)
    sizes = {k: sum(e.size for rel, e in store.manifest(k).files.items() if rel.endswith((".safetensors", ".bin", ".gguf")))
             for k in (base.key, ref.key)}
    if sizes[base.key] > sizes[ref.key]:
        console.print(f"[yellow]the student {base.key} ({sizes[base.key] / 2**20:.1f} MiB of weights) is larger than its "
                      f"teacher {ref.key} ({sizes[ref.key] / 2**20:.1f} MiB): distillation usually goes the other way[/]")
        tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.warning.student_larger": "true"})
    tracking.set_tags(spec.tracking_uri, spec.mlflow_run_id, {"flyroll.teacher": ref.key})
    return ref


def topk_key(dataset: DatasetRef, teacher: PolicyRef, k: int, split: str) -> str:
    """Where the teacher's top-k of a dataset split is stored: beside the dataset, one per teacher and k,
    so a second student of the same teacher and data reuses it."""
    digest = hashlib.sha256(f"{teacher.key}|{k}".encode()).hexdigest()[:12]
    return f"{folder_of(dataset)}/teacher-{digest}-{split}"


def read_topk(store, key: str) -> list[tuple[list, list]]:
    with tempfile.TemporaryDirectory() as d:
        (path,) = [os.path.join(r, n) for r, _, names in os.walk(store.fetch(key, d)) for n in names if n.endswith(".parquet")]
        df = pd.read_parquet(path)
    return [([list(x) for x in ids], [list(x) for x in logps]) for ids, logps in zip(df["ids"], df["logps"], strict=True)]


@task(task_config=ray_job("reference"), **task_resources("reference"))
def teacher_topk(spec: RunSpec, teacher: PolicyRef, dataset: DatasetRef) -> PolicyRef:
    """The teacher's `distill.top_k` next-token log-probs at every response token of the train and eval
    demonstrations, computed on the reference actor and published beside the dataset (`topk_key`,
    parents the dataset split and the teacher); skipped when already there. Returns `teacher`, so the
    training waits for it."""
    cfg = config_of(spec)
    sec = cfg.distill
    store = store_of(spec)
    metrics: dict[str, float] = {}
    with stage(spec, "teacher_topk", 0, metrics):
        folder = folder_of(dataset)
        todo = [s for s in ("train", "eval") if not store.exists(topk_key(dataset, teacher, sec.top_k, s))]
        if todo:
            from engines.training.supervised import batch_of

            tokenizer, _ = _tokenizer(store, teacher.key)
            (worker,) = role_actors(cfg, spec.run_id, "reference")
            ray.get(worker.load.remote("reference", spec, teacher.key))
        for split in todo:
            table = read_table(spec, f"{folder}/{split}")
            examples = encode_rows(table, tokenizer, "distill", cfg.model.apply_chat_template)
            rows = ray.get(worker.topk_logprobs.remote("reference", batch_of(examples, tokenizer.pad_token_id),
                                                       sec.top_k, cfg.training.max_tokens_per_micro_batch))
            key = topk_key(dataset, teacher, sec.top_k, split)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "topk.parquet")
                pd.DataFrame({"ids": [r[0] for r in rows], "logps": [r[1] for r in rows]}).to_parquet(path, index=False)
                store.publish_file(path, key, kind="teacher_topk", producer="teacher_topk",
                                   parents=[f"{folder}/{split}", teacher.key], execution_id=execution_id(),
                                   metadata={"teacher": teacher.key, "top_k": sec.top_k, "rows": len(rows),
                                             "tokens": sum(len(r[0]) for r in rows)})
            metrics[f"teacher_topk/{split}_tokens"] = float(sum(len(r[0]) for r in rows))
        metrics["teacher_topk/computed"] = float(len(todo))
    return teacher
