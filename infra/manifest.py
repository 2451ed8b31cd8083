"""A version's manifest: the record of one artifact version that a reader trusts.

infra/store.py publishes the data files first and the manifest last, and checks every file it
reads against the manifest's sha256 and size (docs/storage.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "flyroll-manifest/1"


def sha256_file(path: str, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """The record of one artifact version; the only thing a reader trusts.

    key:          store key of the version, e.g. "runs/<run_id>/policy/v0003"
    kind:         "checkpoint" | "rollout" | "dataset" | ...
    files:        relative path (posix) -> FileEntry(sha256, size)
    parents:      keys (or full URIs) of the versions this one was made from
    producer:     name of the task that produced it
    execution_id: Flyte execution id, None outside Flyte
    created_at:   ISO-8601 UTC time the manifest was written
    metadata:     free-form JSON (iteration, config_hash, ...)
    """

    key: str
    kind: str
    files: dict[str, FileEntry]
    parents: list[str] = field(default_factory=list)
    producer: str = ""
    execution_id: str | None = None
    created_at: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        d["files"] = {p: asdict(e) for p, e in sorted(self.files.items())}
        return json.dumps({"format": MANIFEST_FORMAT, **d}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, s: str | bytes) -> Manifest:
        d = json.loads(s)
        if not isinstance(d, dict):
            raise ValueError(f"manifest must be a JSON object, got {type(d).__name__}")
        fmt = d.pop("format", MANIFEST_FORMAT)
        if fmt != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {fmt!r} is not supported (expected {MANIFEST_FORMAT!r})")
        for name, typ in (("key", str), ("kind", str), ("files", dict), ("parents", list),
                          ("producer", str), ("created_at", str), ("metadata", dict)):
            if not isinstance(d.get(name), typ):
                raise ValueError(f"manifest field {name!r} must be {typ.__name__}, got {d.get(name)!r:.80}")
        if d.get("execution_id") is not None and not isinstance(d["execution_id"], str):
            raise ValueError(f"manifest field 'execution_id' must be str or null, got {d['execution_id']!r:.80}")
        files = {}
        for p, e in d["files"].items():
            if not (isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)):
                raise ValueError(f"manifest entry for file {p!r} must be {{sha256: str, size: int}}, got {e!r:.80}")
            files[p] = FileEntry(sha256=e["sha256"], size=e["size"])
        return cls(key=d["key"], kind=d["kind"], files=files, parents=list(d["parents"]),
                   producer=d["producer"], execution_id=d.get("execution_id"),
                   created_at=d["created_at"], metadata=d["metadata"])
