"""The run's prompt tables before they are published (tasks/stages/prepare.py `make_dataset`): each `data.sources`
entry's train and eval split, the splits bounded by the policy's tokenizer and context, and the checks
and fingerprints that make_dataset's key and its refusals rest on."""

from __future__ import annotations

import tempfile

import pandas as pd

from engines.data import datasets, sources
from engines.data.datasets import bound_prompts
from engines.data.fingerprint import fingerprint
from engines.data.prompt_mix import domain_quotas, hash_split
from infra.store import ArtifactStore
from tasks.run.types import PolicyRef
from tasks.run.seeds import eval_split_seed

NOT_TOKENIZER = ("model", "pytorch_model", "trainer_state.pt", "critic/")  # weights and training state (store.fetch skip)

_DEFAULT_REWARD = {"synthetic": None, "file": None, "reasoning_gym": "reasoning_gym", "humaneval": "code", "ifeval": "ifeval"}


def source_splits(src: dict, d: dict, seed: int, min_train: int = 1, notes: list[str] | None = None,
                  long_lines: list | None = None) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """(train, eval, problems) of one `data.sources` entry; `problems` = skipped-row reports. A file
    without eval_uri must leave `min_train` train rows after its eval split; a warning that its eval
    split was capped is appended to `notes`, and (file, `LongLines`) of each file with lines over
    data.max_line_bytes (engines/data/text_lines.py) to `long_lines`."""
    n_train, n_eval = src["train_size"] or d["train_size"], src["eval_size"] or d["eval_size"]
    kind, problems = src["kind"], []
    if kind == "synthetic":
        names = tuple(src["names"]) or tuple(d["domains"])
        train, evals = sources.synthetic_source("train", n_train, domains=names, seed=seed), sources.synthetic_source("eval", n_eval, domains=names)
    elif kind == "reasoning_gym":
        fmt = {"config": src.get("settings") or {}, "shots": src.get("shots", 0), "instruction": src.get("instruction")}
        evals = sources.reasoning_gym_source(list(src["names"]), n_eval, eval_split_seed(seed), **fmt)
        held_out = {m["rg_entry"]["question"] for m in evals["metadata"]}  # no train prompt is an eval prompt
        train = sources.reasoning_gym_source(list(src["names"]), n_train, seed, exclude=held_out, **fmt)
    elif kind == "ifeval":
        train, evals = sources.ifeval_source(n_train, seed), sources.ifeval_source(n_eval, eval_split_seed(seed))
    elif kind == "humaneval":  # the last eval_size problems are held out
        every = sources.humaneval_source(None)
        cut = max(1, len(every) - n_eval)
        train, evals = every.iloc[:cut].head(src["train_size"] or cut), every.iloc[cut:]
    else:  # file
        res = datasets.load_prompts(src["uri"], default_domain=src["domain"], max_line_bytes=d["max_line_bytes"])
        problems += _problems(res, long_lines)
        if src["eval_uri"]:
            ev = datasets.load_prompts(src["eval_uri"], default_domain=src["domain"], max_line_bytes=d["max_line_bytes"])
            problems += _problems(ev, long_lines)
            train, evals = res.table.head(src["train_size"] or len(res.table)), ev.table.head(n_eval)
        else:  # eval rows by prompt hash, at most 20 % of the file (engines/data/prompt_mix.py hash_split)
            split = hash_split(res.table, n_eval, min_train=min_train, what=f"data.sources file {src['uri']!r}")
            if split.note and notes is not None:
                notes.append(split.note)
            train, evals = split.train.head(src["train_size"] or len(split.train)), split.evals
        train, evals = datasets.with_prompt_format(train, evals, shots=src.get("shots", 0), instruction=src.get("instruction"),
                                                   seed=seed, what=f"data.sources file {src['uri']!r}")
    out = []
    for df in (train, evals):
        df = df.reset_index(drop=True).copy()
        if src["domain"]:
            reward_fn = _DEFAULT_REWARD[kind]
            df["metadata"] = [{**(m if isinstance(m, dict) else {}), **({"reward_fn": reward_fn or dom} )}
                              for m, dom in zip(df.get("metadata", [{}] * len(df)), df["domain"])]
            df["domain"] = src["domain"]
        out.append(df)
    return out[0], out[1], problems


def _problems(res: datasets.LoadResult, long_lines: list | None) -> list[str]:
    """The report of a loaded file that skipped, dropped or fixed something (else []); (file, its lines
    over data.max_line_bytes) also go to `long_lines`."""
    dropped = res.long_lines is not None and res.long_lines.count > 0
    if dropped and long_lines is not None:
        long_lines.append((res.uri, res.long_lines))
    return [f"{res.uri}: {res.summary()}"] if res.errors or res.notes or dropped else []


def build_splits(d: dict, seed: int, min_train: int = 1, notes: list[str] | None = None,
                 long_lines: list | None = None) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """The train and eval tables (columns prompt_id, domain, prompt, answer, tests, metadata), and the
    skipped-row reports. `min_train` (one iteration's prompts) binds a file source's eval split when it
    is the only source; eval-cap warnings are appended to `notes`, (file, `LongLines`) of the files
    with lines over data.max_line_bytes to `long_lines`."""
    if not d["sources"]:
        specs = [{"kind": "synthetic", "names": tuple(d["domains"]), "domain": None, "train_size": None, "eval_size": None}]
    else:
        specs = d["sources"]
    trains, evals, problems = [], [], []
    for src in specs:
        tr, ev, pr = source_splits(src, d, seed, min_train if len(specs) == 1 else 1, notes, long_lines)
        trains.append(tr)
        evals.append(ev)
        problems += pr
    out = []
    for split, parts in (("train", trains), ("eval", evals)):
        df = pd.concat(parts, ignore_index=True)
        for col in ("answer", "tests", "metadata"):
            if col not in df.columns:
                df[col] = None
        df.insert(0, "prompt_id", [f"{split}-{i}" for i in range(len(df))])
        out.append(df)
    return out[0], out[1], problems


def context_of(store: ArtifactStore, base: PolicyRef) -> int | None:
    """The policy's context length (engines/models/modeling.py `context_length` of its config.json)."""
    from engines.models.modeling import context_length  # transformers (~5 s): see build_base_policy

    with tempfile.TemporaryDirectory() as d:
        return context_length(store.fetch(base.key, d, include=("config.json",)))


def bounded_splits(cfg, store: ArtifactStore, base: PolicyRef, train, evals) -> tuple["pd.DataFrame", "pd.DataFrame", dict]:
    """The splits with no prompt over data.max_prompt_tokens (default: the policy's context minus
    rollout.max_new_tokens), counted with the policy's tokenizer as the rollout encodes them
    (engines/data/datasets.py bound_prompts), and {split: BoundReport}."""
    from engines.models.modeling import context_length, encode_prompts, load_tokenizer  # transformers (~5 s): see build_base_policy

    with tempfile.TemporaryDirectory() as d:
        model_dir = store.fetch(base.key, d, skip=NOT_TOKENIZER)
        tokenizer, context = load_tokenizer(model_dir), context_length(model_dir)
    limit = cfg.data.max_prompt_tokens
    if limit is None:
        if context is None:
            raise ValueError(f"data.max_prompt_tokens: unset, and the policy {base.key} names no context length in its "
                             "config.json (max_position_embeddings); set data.max_prompt_tokens")
        limit = context - cfg.rollout.max_new_tokens
        if limit < 1:
            raise ValueError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                             f"policy's context of {context} tokens ({base.key}); expected max_new_tokens < {context}")

    def count(prompts: list[str]) -> list[int]:
        return [len(ids) for ids in encode_prompts(tokenizer, prompts, cfg.model.apply_chat_template)]

    train, r_train = bound_prompts(train, count, limit, cfg.data.over_length, "train")
    evals, r_eval = bound_prompts(evals, count, limit, cfg.data.over_length, "eval")
    return train, evals, {"train": r_train, "eval": r_eval}


def check_train_split(cfg, domain_rows: dict[str, int]) -> None:
    """Refuse, before any cluster starts, a train split (rows per domain) that lacks a weighted domain
    or holds fewer prompts than one batch (a prompt twice in a batch merges its groups)."""
    weights, batch = dict(cfg.data.domain_weights), cfg.rollout.prompts_per_iteration
    absent = sorted(set(weights) - set(domain_rows))
    if absent:
        raise ValueError(f"data.domain_weights: domain(s) {absent} are not in the train split, which holds "
                         f"{sorted(domain_rows)}; expected a weight per domain of the data")
    need = domain_quotas(weights, batch) if weights else {"": batch}
    have = domain_rows if weights else {"": sum(domain_rows.values())}
    short = {k: (have[k], n) for k, n in need.items() if have[k] < n}
    if short and cfg.rollout.partial_rollout_max_split == 1:
        what = "; ".join(f"{'domain ' + repr(k) + ': ' if k else ''}{h} prompts for {n} per batch" for k, (h, n) in short.items())
        raise ValueError(f"data.train_size={cfg.data.train_size}: the train split holds fewer prompts than one batch of "
                         f"rollout.prompts_per_iteration={batch} ({what}); a prompt would be drawn twice into a batch and "
                         "its groups would merge (same group_id); expected more train prompts, or a smaller batch")


def data_fingerprints(sources) -> dict[str, dict]:
    """{uri: fingerprint} of every file a `data.sources` entry reads (engines/data/fingerprint.py)."""
    uris = sorted({u for src in sources if src.kind == "file" for u in (src.uri, src.eval_uri) if u})
    return {u: fingerprint(u) for u in uris}
