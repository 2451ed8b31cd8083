# longer than 400 lines: reading a prompt table: every format, every row refusal, the nested-column codec
"""Prompt tables: load JSONL/parquet (local or `s3://`), validate row by row, bound, format, write.

A prompt table is a pandas DataFrame with one row per prompt and the columns of `PromptRow`:
`prompt` (str, non-empty), `domain` (str: routes the reward), `answer` (str | None: the
reference final answer), `tests` (str | list[str] | None: code tests), `metadata` (dict: what a
reward function needs besides the answer, e.g. IFEval instruction ids). Every row has an answer
or tests, unless `metadata.reference_free` is true (a domain scored without a reference: IFEval
checks read their spec from metadata; a judge or reward model needs only the prompt).

`load_prompts` never fails on a bad row: a line that is not JSON, lacks a field or has a wrong
type is skipped and reported as `RowError(line, reason)`; a line over `max_line_bytes` (config
`data.max_line_bytes`) is dropped unread and counted (`LoadResult.long_lines`; the file is streamed,
engines/data/text_lines.py, so a huge line costs about that limit in memory); only a missing file, an
empty file, a file that is not UTF-8 or a file without a single good row raise. Columns besides the
schema's are kept in `metadata`.

Parquet cannot hold a column whose cells are dicts of different keys, or a mix of str and list,
so `write_prompts` stores `metadata` and `tests` as JSON text and marks the file; `load_prompts`
decodes them back (`encode_nested` / `decode_nested` do the same for any table).

Which rows go where (the eval split by prompt hash, each batch's domain mix) is engines/data/prompt_mix.py.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator, model_validator

from engines.data.text_lines import DEFAULT_MAX_LINE_BYTES, LongLines, read_lines


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
    notes: list[str] = field(default_factory=list)   # what was fixed while reading (a byte-order mark)
    long_lines: LongLines | None = None       # lines over max_line_bytes, dropped unread (JSONL and CSV files)

    @property
    def rows_read(self) -> int:
        return len(self.table) + len(self.errors) + (self.long_lines.count if self.long_lines else 0)

    def summary(self) -> str:
        head = "; ".join(f"line {e.line}: {e.reason}" for e in self.errors[:5])
        more = f" (+{len(self.errors) - 5} more)" if len(self.errors) > 5 else ""
        notes = "".join(f"; {n}" for n in [self.long_lines.summary() if self.long_lines else "", *self.notes] if n)
        return (f"{self.uri}: {len(self.table)} rows kept, {len(self.errors)} skipped" + (f" [{head}{more}]" if head else "")
                + notes)


def _reason(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "row"
        parts.append(f"{loc}: {err['msg']}" + (f" (got {err['input']!r:.60})" if err["type"] != "missing" and err["loc"] else ""))
    return "; ".join(parts)


def validate_rows(rows, model: type[BaseModel] | None = None) -> tuple[list[dict], list[RowError]]:
    """(good records, errors) for an iterable of (line, dict-or-RowError); each dict validated by
    `model` (a pydantic model with a `record()` method; default `PromptRow`)."""
    model = model or PromptRow
    good, errors = [], []
    for line, row in rows:
        if isinstance(row, RowError):
            errors.append(row)
            continue
        if not isinstance(row, dict):
            errors.append(RowError(line, f"expected a JSON object, got {type(row).__name__}"))
            continue
        try:
            good.append(model.model_validate(row).record())
        except ValidationError as e:
            errors.append(RowError(line, _reason(e)))
    return good, errors


def _jsonl_rows(lines: Iterable[tuple[int, str]]):
    for i, line in lines:
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            yield i, RowError(i, f"not valid JSON ({e.msg} at column {e.colno})")
        except RecursionError:
            yield i, RowError(i, "not valid JSON (nested too deeply)")


def _csv_rows(records: Iterable[tuple[int, str]], uri: str, max_bytes: int):
    """Rows of a CSV file with a header line (prompt, domain, answer, tests, metadata, extras), from its
    records (a quoted cell may span lines; the line numbers are those of the file where a record
    starts). Cells stay text (an answer `042` is kept as written); an empty cell is an absent field; a
    `metadata` cell, and a `tests` cell that is a JSON list, are JSON."""
    # a record is at most max_bytes (engines/data/text_lines.py), so no cell can pass this; the csv module's
    # own default (131,072 characters) would refuse a long cell of a record within the limit
    csv.field_size_limit(max(csv.field_size_limit(), max_bytes))
    header: list[str] | None = None
    for start, text in records:
        try:
            rows = list(csv.reader(io.StringIO(text, newline="")))   # one row (a lone "\r" ends a row too)
        except csv.Error as e:
            if header is None:
                raise ValueError(f"prompt file {uri!r}: the header line is not valid CSV ({e})") from None
            yield start, RowError(start, f"not valid CSV ({e})")
            continue
        for cells in rows:
            if not cells:
                continue
            if header is None:
                if "prompt" not in cells:
                    raise ValueError(f"prompt file {uri!r}: expected a header line naming the columns (prompt, domain, "
                                     f"answer or tests); got {cells}")
                header = cells
                continue
            if len(cells) > len(header):
                yield start, RowError(start, f"{len(cells) - len(header)} cell(s) more than the header's {len(header)} columns")
                continue
            row = {k: v for k, v in zip(header, cells) if v != ""}
            try:
                if isinstance(row.get("metadata"), str):
                    row["metadata"] = json.loads(row["metadata"])
                if isinstance(row.get("tests"), str) and row["tests"].lstrip().startswith("["):
                    row["tests"] = json.loads(row["tests"])
            except json.JSONDecodeError as e:
                yield start, RowError(start, f"metadata/tests cell is not valid JSON ({e.msg})")
                continue
            yield start, row


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
    if name.endswith(".csv"):
        return "csv"
    raise ValueError(f"prompt file {uri!r}: unknown format; expected a .jsonl (or .jsonl.gz), .csv (or .csv.gz) or .parquet file")


@contextlib.contextmanager
def _open(uri: str, storage_options: dict | None):
    """The file at `uri` as a binary stream (a `.gz` file decompressed while it is read)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if not fs.exists(path):
        raise FileNotFoundError(f"prompt file {uri!r} does not exist")
    with fs.open(path, "rb") as f:
        if uri.lower().endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="rb") as g:
                yield g
        else:
            yield f


def _nonblank(lines: Iterable[tuple[int, str]], seen: list[int]):
    """The lines that hold text (a blank line is no row); counted in seen[0]."""
    for i, text in lines:
        if text.strip():
            seen[0] += 1
            yield i, text


def _text_rows(uri: str, fmt: str, storage_options: dict | None, max_line_bytes: int,
               long: LongLines, notes: list[str]) -> list:
    """(line, row or RowError) of a JSONL or CSV file, streamed: no line over `max_line_bytes` is held."""
    seen = [0]
    with _open(uri, storage_options) as f:
        lines = _nonblank(read_lines(f, uri, max_line_bytes, long, notes, csv_records=fmt == "csv"), seen)
        try:
            rows = list(_jsonl_rows(lines) if fmt == "jsonl" else _csv_rows(lines, uri, max_line_bytes))
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ValueError(f"prompt file {uri!r} is not a readable gzip file ({type(e).__name__}: {e})") from None
    if not seen[0] and not long.count:
        raise ValueError(f"prompt file {uri!r} is empty; expected one JSON object per line (prompt, domain, answer or tests)")
    return rows


def read_rows(uri: str, *, storage_options: dict | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
              what: str = "prompt file") -> tuple[list, list[str], LongLines, str]:
    """(rows, notes, long lines, format) of a JSONL, CSV or parquet file (local path or fsspec URL):
    each row is (line, dict or RowError), not yet validated; `what` names the file in errors. The
    readers every row table shares (prompt tables here, SFT and preference tables in
    engines/data/tuning_rows.py)."""
    if max_line_bytes < 1:
        raise ValueError(f"data.max_line_bytes={max_line_bytes}; expected a positive number of bytes")
    fmt = _format(uri)
    notes: list[str] = []
    long = LongLines(max_line_bytes)
    if fmt in ("jsonl", "csv"):
        rows = _text_rows(uri, fmt, storage_options, max_line_bytes, long, notes)
    else:
        with _open(uri, storage_options) as f:
            raw = f.read()
        if not raw.strip():
            raise ValueError(f"{what} {uri!r} is empty; expected a parquet file")
        try:
            rows = list(_parquet_rows(raw))
        except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for a corrupt file
            raise ValueError(f"{what} {uri!r} is not a readable parquet file ({type(e).__name__}: {e})") from e
    return rows, notes, long, fmt


def load_prompts(uri: str, *, storage_options: dict | None = None, default_domain: str | None = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> LoadResult:
    """The good rows of a JSONL, CSV or parquet prompt file (local path or fsspec URL, e.g. `s3://`),
    and a RowError for each bad one. A row without a `domain` takes `default_domain` (a source's
    `domain`), when given. A JSONL line (CSV record) over `max_line_bytes` bytes is dropped unread
    and counted in `long_lines` (config `data.max_line_bytes`). Raises FileNotFoundError (missing
    file), ValueError (unknown format, empty file, not UTF-8, no good row)."""
    rows, notes, long, fmt = read_rows(uri, storage_options=storage_options, max_line_bytes=max_line_bytes)
    if default_domain:
        rows = [(i, {**r, "domain": r.get("domain") or default_domain} if isinstance(r, dict) else r) for i, r in rows]
    good, errors = validate_rows(rows)
    result = LoadResult(table_of(good), errors, uri, notes, long if fmt != "parquet" else None)
    if not good:
        raise ValueError(f"prompt file {uri!r} has no valid row ({len(errors)} rejected): " + result.summary())
    return result


@dataclass(frozen=True)
class BoundReport:
    """What `bound_prompts` did to one split."""

    limit: int                 # max tokens per prompt
    action: str                # drop | truncate | error
    over: int = 0              # rows over the limit (dropped or truncated)
    longest: int = 0           # tokens of the longest of them
    longest_id: str = ""       # its prompt_id (or row number)

    def summary(self, split: str) -> str:
        if not self.over:
            return ""
        done = {"drop": "dropped", "truncate": "truncated to their last"}[self.action]
        return (f"{split}: {self.over} prompt(s) longer than data.max_prompt_tokens={self.limit} tokens {done}"
                f"{f' {self.limit} tokens' if self.action == 'truncate' else ''} (longest: {self.longest} tokens, "
                f"{self.longest_id})")


def _keep_tail(text: str, count_tokens, limit: int) -> str:
    """The longest suffix of `text` whose `count_tokens` is <= `limit` (binary search over its length)."""
    lo, hi = 0, len(text)          # count_tokens(text[-lo:]) <= limit holds for lo (lo = 0: the empty prompt)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens([text[len(text) - mid:]])[0] <= limit:
            lo = mid
        else:
            hi = mid - 1
    return text[len(text) - lo:]


def bound_prompts(df: pd.DataFrame, count_tokens, max_tokens: int, over_length: str = "drop",
                  split: str = "train") -> tuple[pd.DataFrame, BoundReport]:
    """Rows of prompt table `df` whose prompt is at most `max_tokens` tokens (`count_tokens(list of
    prompts) -> list of token counts`, as the policy will encode them), and a report.

    over_length: 'drop' leaves longer rows out; 'truncate' keeps each longer prompt's last tokens
    (its end holds the question and the answer format) and records the original length in
    metadata.truncated_from_tokens; 'error' raises ValueError naming the first longer row."""
    if over_length not in ("drop", "truncate", "error"):
        raise ValueError(f"data.over_length: {over_length!r}; expected 'drop', 'truncate' or 'error'")
    counts = count_tokens(df["prompt"].tolist()) if len(df) else []
    over = [i for i, n in enumerate(counts) if n > max_tokens]
    if not over:
        return df, BoundReport(max_tokens, over_length)
    ids = df["prompt_id"].tolist() if "prompt_id" in df.columns else [f"row {i + 1}" for i in range(len(df))]
    worst = max(over, key=lambda i: counts[i])
    report = BoundReport(max_tokens, over_length, len(over), counts[worst], str(ids[worst]))
    if over_length == "error":
        first = over[0]
        raise ValueError(f"{split} prompt {ids[first]} (domain {df['domain'].iloc[first]!r}) is {counts[first]} tokens, "
                         f"over data.max_prompt_tokens={max_tokens} ({len(over)} such row(s), the longest "
                         f"{report.longest} tokens); expected shorter prompts, or data.over_length 'drop' or 'truncate'")
    if over_length == "drop":
        return df.drop(index=df.index[over]).reset_index(drop=True), report
    out = df.copy()
    for i in over:
        kept = _keep_tail(out["prompt"].iloc[i], count_tokens, max_tokens)
        if not kept.strip():
            raise ValueError(f"{split} prompt {ids[i]}: nothing of it fits in data.max_prompt_tokens={max_tokens} tokens "
                             "(the chat template alone may take more); raise data.max_prompt_tokens")
        out.iat[i, out.columns.get_loc("prompt")] = kept
        meta = out["metadata"].iloc[i]
        out.iat[i, out.columns.get_loc("metadata")] = {**(meta if isinstance(meta, dict) else {}),
                                                       "truncated_from_tokens": counts[i]}
    return out, report


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


def with_prompt_format(train: pd.DataFrame, evals: pd.DataFrame, *, shots: int = 0, instruction: str | None = None,
                       seed: int = 0, what: str = "source") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, eval) with each prompt formatted for a model that continues text rather than follows
    instructions: with `shots` = k > 0, k solved examples drawn from the TRAIN rows (never eval, so
    nothing of the eval split leaks into a prompt; the same k for every prompt, chosen by `seed`, a
    row's own example swapped for the next one), as "Question: ...\nAnswer: ...\n\n" blocks, then
    "Question: <prompt>\nAnswer:" -- the response is the text after it, so stop at a newline
    (rollout.stop: ["\n"]). `instruction`, when given, comes first (with shots) or after the
    question (without). The raw prompt is kept in metadata.question. Examples need an `answer`: a
    split with fewer than k + 1 answered rows raises ValueError naming `what`."""
    if not shots and not instruction:
        return train, evals
    examples: list[tuple[str, str]] = []
    if shots:
        answered = train[train["answer"].notna()]
        if len(answered) < shots + 1:
            raise ValueError(f"{what}: shots={shots} needs at least {shots + 1} train rows with an answer to draw "
                             f"examples from; it has {len(answered)}")
        picked = answered.sample(n=shots + 1, random_state=seed)
        examples = list(zip(picked["prompt"], picked["answer"]))

    def fmt(df: pd.DataFrame) -> pd.DataFrame:
        df = df.copy()
        prompts = []
        for q in df["prompt"]:
            if shots:
                shown = [e for e in examples if e[0] != q][:shots]
                head = (f"{instruction}\n\n" if instruction else "") + "".join(f"Question: {eq}\nAnswer: {ea}\n\n" for eq, ea in shown)
                prompts.append(f"{head}Question: {q}\nAnswer:")
            else:
                prompts.append(f"{q}\n\n{instruction}")
        df["metadata"] = [{**(m if isinstance(m, dict) else {}), "question": q} for m, q in zip(df["metadata"], df["prompt"])]
        df["prompt"] = prompts
        return df

    return fmt(train), fmt(evals)
