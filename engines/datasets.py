"""Prompt tables: load JSONL/parquet (local or `s3://`), validate row by row, mix domains.

A prompt table is a pandas DataFrame with one row per prompt and the columns of `PromptRow`:
`prompt` (str, non-empty), `domain` (str: routes the reward), `answer` (str | None: the
reference final answer), `tests` (str | list[str] | None: code tests), `metadata` (dict: what a
reward function needs besides the answer, e.g. IFEval instruction ids). Every row has an answer
or tests, unless `metadata.reference_free` is true (a domain scored without a reference: IFEval
checks read their spec from metadata; a judge or reward model needs only the prompt).

`load_prompts` never fails on a bad row: a line that is not JSON, lacks a field or has a wrong
type is skipped and reported as `RowError(line, reason)`; only a missing file, an empty file or a
file without a single good row raise. Columns besides the schema's are kept in `metadata`.

Parquet cannot hold a column whose cells are dicts of different keys, or a mix of str and list,
so `write_prompts` stores `metadata` and `tests` as JSON text and marks the file; `load_prompts`
decodes them back (`encode_nested` / `decode_nested` do the same for any table).

`mix_domains` follows ROLL's `domain_interleave_probs`: each batch of n prompts gets a fixed
quota per domain (weight x n), drawn from that domain's own table, so every batch realises the
mix (up to rounding), not only the average over many batches. ROLL gives all rounding to the
last domain; here the largest remainders get it, so no domain is favoured by its order.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator, model_validator

COLUMNS = ("prompt", "domain", "answer", "tests", "metadata")
_JSON_COLUMNS_KEY = b"flyroll.json_columns"      # parquet schema metadata: columns stored as JSON text


class PromptRow(BaseModel):
    """One prompt. Unknown keys go to `metadata`; a numeric `answer` (42, 0.5) is kept as text."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: StrictStr = Field(min_length=1)
    domain: StrictStr = Field(min_length=1)
    answer: StrictStr | None = None
    tests: StrictStr | list[StrictStr] | None = None
    metadata: dict = Field(default_factory=dict)

    @field_validator("answer", mode="before")
    @classmethod
    def _number_answer(cls, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return str(v)
        return v

    @field_validator("metadata", mode="before")
    @classmethod
    def _null_metadata(cls, v):
        return {} if v is None else v

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("prompt is blank")
        return v

    @model_validator(mode="after")
    def _answer_or_tests(self):
        if self.answer is None and not self.tests and self.metadata.get("reference_free") is not True:
            raise ValueError("row has neither 'answer' nor 'tests' (nor metadata.reference_free=true); a reward needs one of them")
        return self

    def record(self) -> dict:
        extra = dict(self.model_extra or {})
        meta = {**extra, **self.metadata}
        return {"prompt": self.prompt, "domain": self.domain, "answer": self.answer,
                "tests": self.tests, "metadata": meta}


@dataclass(frozen=True)
class RowError:
    line: int            # 1-based line of a JSONL file; 1-based row number of a parquet file
    reason: str


@dataclass
class LoadResult:
    table: pd.DataFrame                       # the good rows, columns COLUMNS
    errors: list[RowError] = field(default_factory=list)
    uri: str = ""

    @property
    def rows_read(self) -> int:
        return len(self.table) + len(self.errors)

    def summary(self) -> str:
        head = "; ".join(f"line {e.line}: {e.reason}" for e in self.errors[:5])
        more = f" (+{len(self.errors) - 5} more)" if len(self.errors) > 5 else ""
        return f"{self.uri}: {len(self.table)} rows kept, {len(self.errors)} skipped" + (f" [{head}{more}]" if head else "")


def _reason(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "row"
        parts.append(f"{loc}: {err['msg']}" + (f" (got {err['input']!r:.60})" if err["type"] != "missing" and err["loc"] else ""))
    return "; ".join(parts)


def validate_rows(rows) -> tuple[list[dict], list[RowError]]:
    """(good records, errors) for an iterable of (line, dict-or-RowError)."""
    good, errors = [], []
    for line, row in rows:
        if isinstance(row, RowError):
            errors.append(row)
            continue
        if not isinstance(row, dict):
            errors.append(RowError(line, f"expected a JSON object, got {type(row).__name__}"))
            continue
        try:
            good.append(PromptRow.model_validate(row).record())
        except ValidationError as e:
            errors.append(RowError(line, _reason(e)))
    return good, errors


def _jsonl_rows(raw: bytes):
    for i, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            yield i, RowError(i, f"not valid JSON ({e.msg} at column {e.colno})")


def _plain(v):
    """numpy arrays / scalars from parquet as plain Python lists / values."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, float) and v != v:      # pandas' missing value in a str column
        return None
    return v


def _parquet_rows(raw: bytes):
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(raw))
    meta = table.schema.metadata or {}
    json_cols = set(json.loads(meta.get(_JSON_COLUMNS_KEY, b"[]")))
    for i, row in enumerate(table.to_pylist(), start=1):
        row = {k: v for k, v in row.items() if v is not None or k in COLUMNS}   # absent extras
        try:
            for c in json_cols & set(row):
                if isinstance(row[c], str):
                    row[c] = json.loads(row[c])
            if isinstance(row.get("metadata"), str) and row["metadata"].lstrip().startswith("{"):
                row["metadata"] = json.loads(row["metadata"])
        except json.JSONDecodeError as e:
            yield i, RowError(i, f"column holds invalid JSON ({e.msg})")
            continue
        yield i, _plain(row)


def _format(uri: str) -> str:
    name = uri.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise ValueError(f"prompt file {uri!r}: unknown format; expected a .jsonl (or .jsonl.gz) or .parquet file")


def _read_bytes(uri: str, storage_options: dict | None) -> bytes:
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if not fs.exists(path):
        raise FileNotFoundError(f"prompt file {uri!r} does not exist")
    with fs.open(path, "rb") as f:
        raw = f.read()
    if uri.lower().endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw


def load_prompts(uri: str, *, storage_options: dict | None = None) -> LoadResult:
    """The good rows of a JSONL or parquet prompt file (local path or fsspec URL, e.g. `s3://`),
    and a RowError for each bad one. Raises FileNotFoundError (missing file), ValueError (unknown
    format, empty file, no good row)."""
    fmt = _format(uri)
    raw = _read_bytes(uri, storage_options)
    if not raw.strip():
        raise ValueError(f"prompt file {uri!r} is empty; expected one JSON object per line (prompt, domain, answer or tests)")
    if fmt == "jsonl":
        rows = _jsonl_rows(raw)
    else:
        try:
            rows = list(_parquet_rows(raw))
        except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for a corrupt file
            raise ValueError(f"prompt file {uri!r} is not a readable parquet file ({type(e).__name__}: {e})") from e
    good, errors = validate_rows(rows)
    result = LoadResult(table_of(good), errors, uri)
    if not good:
        raise ValueError(f"prompt file {uri!r} has no valid row ({len(errors)} rejected): " + result.summary())
    return result


def table_of(records: list[dict]) -> pd.DataFrame:
    """Validated records as a prompt table; object columns, so a missing answer stays None."""
    return pd.DataFrame(records, columns=list(COLUMNS), dtype=object)


def encode_nested(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with `metadata` and `tests` as JSON text, so parquet can hold any mix of them."""
    out = df.copy()
    for c in ("metadata", "tests"):
        if c in out.columns:
            out[c] = [None if v is None else json.dumps(_plain(v), sort_keys=True) for v in out[c]]
    return out


def decode_nested(df: pd.DataFrame) -> pd.DataFrame:
    """Inverse of `encode_nested` (cells already decoded are left alone)."""
    out = df.copy()
    for c in ("metadata", "tests"):
        if c in out.columns:
            out[c] = [json.loads(v) if isinstance(v, str) else _plain(v) for v in out[c]]
    if "metadata" in out.columns:
        out["metadata"] = [v if isinstance(v, dict) else {} for v in out["metadata"]]
    return out


def write_prompts(df: pd.DataFrame, uri: str, *, storage_options: dict | None = None) -> str:
    """Write a prompt table as JSONL or parquet (by extension) that `load_prompts` reads back."""
    import fsspec

    fmt = _format(uri)
    with fsspec.open(uri, "wb", compression="infer", **(storage_options or {})) as f:
        if fmt == "jsonl":
            for rec in df.to_dict(orient="records"):
                f.write((json.dumps(_plain(rec), ensure_ascii=False) + "\n").encode())
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.Table.from_pandas(encode_nested(df), preserve_index=False)
            cols = [c for c in ("metadata", "tests") if c in df.columns]
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), _JSON_COLUMNS_KEY: json.dumps(cols).encode()})
            pq.write_table(table, f)
    return uri


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
