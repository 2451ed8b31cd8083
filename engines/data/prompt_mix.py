"""Which prompts go where: a file's eval split by prompt hash (`hash_split`) and each batch's domain
mix (`mix_domains`). engines/data/datasets.py loads and validates the tables these divide.

`hash_split` puts a row in eval by its prompt's hash, not its position, so appending rows to a file
never moves an old train row into eval (docs/data.md, "The eval split of a file").

`mix_domains` follows ROLL's `domain_interleave_probs`: each batch of n prompts gets a fixed
quota per domain (weight x n), drawn from that domain's own table, so every batch realises the
mix (up to rounding), not only the average over many batches. ROLL gives all rounding to the
last domain; here the largest remainders get it, so no domain is favoured by its order.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd


EVAL_MAX_FRACTION = 0.2     # a file's eval split holds at most this share of its rows


def row_unit(prompt: str) -> float:
    """A row's place in [0, 1): the first 8 bytes of sha256(prompt). Depends on the prompt alone, so a
    row keeps it however many rows are appended around it (duplicates of a prompt share it)."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class HashSplit:
    train: pd.DataFrame
    evals: pd.DataFrame
    asked: int           # eval rows asked for (data.eval_size)
    fraction: float      # eval rows are those with row_unit < fraction
    note: str = ""       # a warning when the cap made the eval split smaller than asked


def hash_split(df: pd.DataFrame, eval_size: int, *, min_train: int = 1, what: str = "prompt file") -> HashSplit:
    """Split one prompt table into train and eval by each row's prompt hash (`row_unit`), not by position.

    A row is eval iff row_unit(prompt) < fraction, fraction = min(eval_size / rows, EVAL_MAX_FRACTION):
    the eval split holds about eval_size rows, at most ~20 % of the file. Appended rows never move an
    old train row into eval; while the 20 % cap decides (files up to 5 x eval_size rows) the old rows
    keep their side exactly, and past it the fraction shrinks with growth, so an eval row with one of
    the highest hashes may become a train row. When the cap takes rows off eval_size, `note` names both
    numbers. Raises ValueError naming the numbers when the eval split would be empty, or the train split
    would hold fewer than `min_train` rows (one iteration's prompts)."""
    n = len(df)
    fraction = min(eval_size / n, EVAL_MAX_FRACTION) if n else 0.0
    is_eval = [row_unit(p) < fraction for p in df["prompt"]]
    evals = df[is_eval].reset_index(drop=True)
    train = df[[not e for e in is_eval]].reset_index(drop=True)
    if len(train) < min_train:
        raise ValueError(f"{what}: {n} rows; holding out {len(evals)} for eval (asked data.eval_size={eval_size}, at most "
                         f"{EVAL_MAX_FRACTION:.0%} of the rows) leaves {len(train)} train prompts, fewer than one iteration's "
                         f"rollout.prompts_per_iteration={min_train}; expected more rows, a separate eval file (eval_uri) or "
                         "a smaller prompts_per_iteration")
    if not len(evals):
        raise ValueError(f"{what}: {n} rows; no row fell into the eval split (eval_size={eval_size}, at most "
                         f"{EVAL_MAX_FRACTION:.0%} of the rows by prompt hash); expected more rows or a separate eval file (eval_uri)")
    note = ""
    if eval_size > EVAL_MAX_FRACTION * n:
        note = (f"{what}: data.eval_size={eval_size} asked, {len(evals)} used: the eval split is capped at "
                f"{EVAL_MAX_FRACTION:.0%} of the file's {n} rows (by prompt hash), leaving {len(train)} train prompts")
    return HashSplit(train, evals, eval_size, fraction, note)


def split_by_domain(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """{domain: its rows}, for `mix_domains`."""
    return {str(d): g.reset_index(drop=True) for d, g in df.groupby("domain", sort=True)}


def domain_quotas(weights: dict[str, float], n: int) -> dict[str, int]:
    """Prompts per domain in a batch of `n`: floor(w/sum(w) * n), the rest to the largest remainders
    (ties: the order of `weights`). Zero-weight domains get 0."""
    bad = {k: w for k, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"domain weights must be finite and >= 0, got {bad}")
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError(f"domain weights sum to {total}; at least one must be > 0: {weights}")
    exact = {k: w / total * n for k, w in weights.items()}
    quotas = {k: int(math.floor(v)) for k, v in exact.items()}
    rest = n - sum(quotas.values())
    for k in sorted(exact, key=lambda k: -(exact[k] - quotas[k]))[:rest]:
        quotas[k] += 1
    return quotas


def mix_domains(tables: dict[str, pd.DataFrame], weights: dict[str, float], n: int, seed: int) -> pd.DataFrame:
    """`n` prompts mixed by `weights` ({domain: weight}, normalised; ROLL's domain_interleave_probs).

    Each domain's quota (`domain_quotas`) is drawn from `tables[domain]` without replacement,
    reshuffling and starting over when the quota exceeds the table. The `domain` column of the
    result is the key of the table each row came from; rows are shuffled. Deterministic in `seed`.
    """
    missing = [d for d, w in weights.items() if w > 0 and (d not in tables or len(tables[d]) == 0)]
    if missing:
        raise ValueError(f"mix_domains: no prompts for weighted domain(s) {missing}; tables have {sorted(tables)}")
    rng = np.random.default_rng(seed)
    parts = []
    for domain, quota in domain_quotas(weights, n).items():
        if quota == 0:
            continue
        table = tables[domain]
        order = np.concatenate([rng.permutation(len(table)) for _ in range(math.ceil(quota / len(table)))])[:quota]
        part = table.iloc[order].copy()
        part["domain"] = domain
        parts.append(part)
    out = pd.concat(parts, ignore_index=True)
    return out.iloc[rng.permutation(len(out))].reset_index(drop=True)


def realised_mix(df: pd.DataFrame) -> dict[str, float]:
    """{domain: fraction of rows} of a batch (sorted by domain)."""
    if len(df) == 0:
        return {}
    counts = df["domain"].value_counts()
    return {str(d): float(counts[d]) / len(df) for d in sorted(counts.index)}
