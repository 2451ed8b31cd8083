"""The versioned artifact store: immutable, hash-checked versions in object storage.

A version is a folder under the store root named by its key (`runs/<run_id>/policy/v0003`):
the data files, then `MANIFEST.json` listing every file with its sha256 and size, the parent
versions, the producing task and Flyte execution id. Readers trust only a manifest:

- publish uploads the data files first and the manifest last (one PUT on S3; temp file +
  rename on a local disk), so an interrupted publish leaves no visible version;
- fetch downloads exactly the files the manifest names and checks each sha256;
- a published version is immutable: publishing different content to the same key raises
  `ArtifactExists`, publishing identical content again (a retried task) returns the manifest
  (`prune` drops files of old checkpoints; `delete` removes a version, used only for a partial
  rollout's carry, which a rerun of its iteration replaces).

Roots: a local folder (`/data/store`, `file:///data/store`) or `s3://bucket/prefix` through s3fs.
S3 endpoint and credentials come from `storage_options` (`endpoint_url`, `key`, `secret`) or the
standard env vars (`AWS_ENDPOINT_URL` / `FSSPEC_S3_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`); they are never logged or written anywhere. Every remote call retries
connection-type errors with exponential backoff, then raises `StoreUnavailable` naming the URI.
See docs/storage.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

import fsspec

log = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "flyroll-manifest/1"
_T = TypeVar("_T")


class StoreError(Exception):
    """Base class of the store's errors."""


class ArtifactNotFound(StoreError):
    def __init__(self, key: str, uri: str):
        super().__init__(f"no artifact version {key!r}: {uri}/{MANIFEST_NAME} does not exist "
                         "(never published, or its publish did not finish)")
        self.key = key


class CorruptArtifact(StoreError):
    """A manifest that does not parse, or a file whose bytes do not match its manifest."""


class ArtifactExists(StoreError):
    """A version with different content is already published under this key."""


class StoreUnavailable(StoreError):
    """The object store did not answer after all retries."""


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


def _is_transient(e: BaseException) -> bool:
    """Connection-type errors worth retrying; not-found, permission and the like are not."""
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno in (errno.EBUSY, errno.EAGAIN, errno.EREMOTEIO):
        return True  # s3fs maps SlowDown / ServiceUnavailable / InternalError (5xx) to these
    names = {c.__module__.split(".")[0] + "." + c.__name__ for c in type(e).__mro__}
    return bool(names & {"botocore.ConnectionError", "botocore.HTTPClientError",
                         "aiohttp.ClientConnectionError", "aiohttp.ClientPayloadError",
                         "fsspec.FSTimeoutError"})


def _s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """s3fs kwargs: explicit options win, then the standard env vars; we do our own retries."""
    opts = dict(storage_options)
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    endpoint = (opts.pop("endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
                or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("FSSPEC_S3_ENDPOINT_URL"))
    if endpoint:
        opts["endpoint_url"] = endpoint
    for opt, env in (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY")):
        if not opts.get(opt) and os.environ.get(env):
            opts[opt] = os.environ[env]
    opts["client_kwargs"] = client_kwargs
    config_kwargs = {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 1}}
    opts["config_kwargs"] = {**config_kwargs, **(opts.get("config_kwargs") or {})}
    opts.setdefault("use_listings_cache", False)  # a listing must see versions published since
    opts["skip_instance_cache"] = True
    return opts


class ArtifactStore:
    """Immutable, hash-checked artifact versions under one root (local folder or s3://)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None,
                 retries: int = 4, backoff_s: float = 0.5):
        if not root:
            raise ValueError("ArtifactStore root is empty: expected a folder path, file:// or s3:// URI")
        self.root = root.rstrip("/") or "/"
        self.retries = retries
        self.backoff_s = backoff_s
        protocol = fsspec.core.split_protocol(self.root)[0] or "file"
        if protocol == "file":
            self.fs = fsspec.filesystem("file", auto_mkdir=True)
            local = fsspec.core.split_protocol(self.root)[1]
            self.root = ("file://" if self.root.startswith("file://") else "") + os.path.abspath(local)
            self._local = True
        elif protocol in ("s3", "s3a"):
            self.fs = fsspec.filesystem("s3", **_s3_options(storage_options or {}))
            self.fs.retries = 1  # s3fs's own retry loop; ours below replaces it
            self._local = False
        else:
            self.fs = fsspec.filesystem(protocol, **(storage_options or {}))
            self._local = False
        self._root_path = self.fs._strip_protocol(self.root).rstrip("/")

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"ArtifactStore({self.root!r})"

    # -- addressing --------------------------------------------------------------------------

    def uri(self, key: str) -> str:
        return f"{self.root}/{_check_key(key)}"

    def _path(self, key: str, rel: str = "") -> str:
        return f"{self._root_path}/{_check_key(key)}" + (f"/{rel}" if rel else "")

    def _retry(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not _is_transient(e):
                    raise
                if attempt == self.retries:
                    raise StoreUnavailable(
                        f"object store unreachable: {what} failed after {attempt + 1} attempts "
                        f"({type(e).__name__}: {e})") from e
                delay = self.backoff_s * 2 ** attempt
                log.warning("store: %s failed (%s: %s), retry %d/%d in %.1fs",
                            what, type(e).__name__, e, attempt + 1, self.retries, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def check_writable(self) -> None:
        """Write and delete a small probe object under the root (the folder is created if need be), so a
        read-only or unreachable store fails at the start of a run, not at its first publish. Raises
        StoreError naming the root and the cause."""
        probe = f"{self._root_path}/.write-probe-{uuid.uuid4().hex}"
        try:
            self._retry(f"write {self.root}", self.fs.pipe_file, probe, b"flyroll write probe")
            self._retry(f"delete {self.root}", self.fs.rm_file, probe)
        except StoreUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 -- OSError locally; s3fs raises PermissionError and others
            raise StoreError(f"artifact store {self.root} is not writable: writing a probe object failed "
                             f"({type(e).__name__}: {e})") from e

    # -- reading -----------------------------------------------------------------------------

    def manifest(self, key: str) -> Manifest:
        path = self._path(key, MANIFEST_NAME)
        try:
            raw = self._retry(f"read {self.uri(key)}/{MANIFEST_NAME}", self.fs.cat_file, path)
        except FileNotFoundError:
            raise ArtifactNotFound(key, self.uri(key)) from None
        try:
            return Manifest.from_json(raw)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise CorruptArtifact(f"manifest {self.uri(key)}/{MANIFEST_NAME} is unreadable: {e}") from e

    def exists(self, key: str) -> bool:
        try:
            self.manifest(key)
            return True
        except (ArtifactNotFound, CorruptArtifact):
            return False

    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` (a folder-like key) that have a manifest, sorted."""
        prefix = prefix.strip("/")
        base = self._path(prefix) if prefix else self._root_path
        found = self._retry(f"list {self.root}/{prefix}", self.fs.find, base)
        suffix = "/" + MANIFEST_NAME
        keys = [p[len(self._root_path) + 1:-len(suffix)] for p in found if p.endswith(suffix)]
        return sorted(k for k in keys if k)

    def fetch(self, key: str, local_dir: str, verify: bool = True, skip: tuple[str, ...] = (),
              include: tuple[str, ...] | None = None) -> str:
        """Download every file of a version into local_dir and check it against the manifest;
        `skip`: leave out the files whose relative path starts with one of these; `include`: only
        the files whose relative path starts with one of these (None: all)."""
        m = self.manifest(key)
        rels = sorted(r for r in m.files if not r.startswith(tuple(skip))
                      and (include is None or r.startswith(tuple(include))))
        lpaths = [os.path.join(local_dir, *rel.split("/")) for rel in rels]
        for lp in lpaths:
            os.makedirs(os.path.dirname(lp), exist_ok=True)
        try:
            self._retry(f"download {self.uri(key)}", self.fs.get, [self._path(key, r) for r in rels], lpaths)
        except FileNotFoundError as e:
            raise CorruptArtifact(f"artifact {self.uri(key)} is missing a file its manifest lists: {e}") from e
        if verify:
            for rel, lp in zip(rels, lpaths):
                want = m.files[rel]
                size = os.path.getsize(lp) if os.path.exists(lp) else -1
                if size != want.size or sha256_file(lp) != want.sha256:
                    raise CorruptArtifact(
                        f"artifact {self.uri(key)}: file {rel!r} does not match its manifest "
                        f"(size {size} vs {want.size}, or sha256 differs from {want.sha256[:12]}...)")
        return local_dir

    # -- publishing --------------------------------------------------------------------------

    def publish(self, local_dir: str, key: str, *, kind: str, producer: str, parents: list[str] = (),
                execution_id: str | None = None, metadata: dict[str, Any] | None = None) -> Manifest:
        """Upload every file under local_dir as version `key`; the manifest goes last."""
        if not os.path.isdir(local_dir):
            raise ValueError(f"publish: local_dir {local_dir!r} is not a directory")
        rels = []
        for dirpath, _, names in os.walk(local_dir, followlinks=True):
            for n in names:
                rels.append(os.path.relpath(os.path.join(dirpath, n), local_dir).replace(os.sep, "/"))
        if not rels:
            raise ValueError(f"publish: local_dir {local_dir!r} holds no files")
        if MANIFEST_NAME in rels:
            raise ValueError(f"publish: {local_dir!r} already holds a {MANIFEST_NAME}; "
                             "that name is reserved for the store's manifest")
        return self._publish({r: os.path.join(local_dir, *r.split("/")) for r in sorted(rels)}, key,
                             kind=kind, producer=producer, parents=parents,
                             execution_id=execution_id, metadata=metadata)

    def publish_file(self, local_file: str, key: str, *, kind: str, producer: str, parents: list[str] = (),
                     execution_id: str | None = None, metadata: dict[str, Any] | None = None) -> Manifest:
        """Publish one file (e.g. a parquet rollout table) as version `key`, under its own name."""
        if not os.path.isfile(local_file):
            raise ValueError(f"publish_file: {local_file!r} is not a file")
        name = os.path.basename(local_file)
        if name == MANIFEST_NAME:
            raise ValueError(f"publish_file: the name {MANIFEST_NAME} is reserved for the store's manifest")
        return self._publish({name: local_file}, key, kind=kind, producer=producer, parents=parents,
                             execution_id=execution_id, metadata=metadata)

    def _publish(self, files: dict[str, str], key: str, *, kind: str, producer: str, parents: list[str],
                 execution_id: str | None, metadata: dict[str, Any] | None) -> Manifest:
        _check_key(key)
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata)
        except TypeError as e:
            raise TypeError(f"publish {key!r}: metadata must be JSON-serialisable ({e})") from e
        entries = {rel: FileEntry(sha256=sha256_file(p), size=os.path.getsize(p)) for rel, p in files.items()}

        if self.exists(key):  # immutable versions; a retried task that made the same bytes is fine
            old = self.manifest(key)
            if old.files == entries and old.kind == kind:
                log.info("store: %s already published with identical files, keeping it", self.uri(key))
                return old
            raise ArtifactExists(f"artifact version {self.uri(key)} is already published with different "
                                 "content; versions are immutable, publish under a new key")

        rels = list(files)
        self._retry(f"upload to {self.uri(key)}", self.fs.put, [files[r] for r in rels],
                    [self._path(key, r) for r in rels])
        remote = self._retry(f"list {self.uri(key)}", self.fs.find, self._path(key), detail=True)
        for rel in rels:
            got = remote.get(self._path(key, rel), {}).get("size")
            if got != entries[rel].size:
                raise StoreUnavailable(f"upload of {self.uri(key)}/{rel} is incomplete: "
                                       f"{got} bytes stored, {entries[rel].size} expected")

        m = Manifest(key=key, kind=kind, files=entries, parents=list(parents), producer=producer,
                     execution_id=execution_id, created_at=datetime.now(timezone.utc).isoformat(),
                     metadata=metadata)
        self._write_manifest(key, m.to_json().encode())
        log.info("store: published %s (%s, %d files)", self.uri(key), kind, len(entries))
        return m

    def prune(self, key: str, rels: list[str], reason: str) -> Manifest:
        """Drop files from a published version (a retention policy: old versions' optimizer state):
        the manifest is rewritten without them, recording each under `metadata["pruned"]` with
        `reason`, and only then are the files deleted, so a reader never sees a manifest listing a
        missing file. The one change a published version can undergo (besides `delete`). Files the manifest does not
        list are ignored: pruning twice is a no-op."""
        m = self.manifest(key)
        drop = sorted(r for r in rels if r in m.files)
        if not drop:
            return m
        pruned = {**m.metadata.get("pruned", {}), **{r: reason for r in drop}}
        new = Manifest(key=m.key, kind=m.kind, files={r: e for r, e in m.files.items() if r not in drop},
                       parents=m.parents, producer=m.producer, execution_id=m.execution_id, created_at=m.created_at,
                       metadata={**m.metadata, "pruned": pruned})
        self._write_manifest(key, new.to_json().encode())
        for rel in drop:
            try:
                self._retry(f"delete {self.uri(key)}/{rel}", self.fs.rm_file, self._path(key, rel))
            except FileNotFoundError:
                pass
        return new

    def delete(self, key: str) -> None:
        """Remove version `key`: its manifest first (the version is gone for every reader at once),
        then the files it lists. For the one artifact a rerun replaces, a partial rollout's carry
        (tasks/partial_rollout.py); checkpoints and rollout tables are never deleted."""
        m = self.manifest(key)
        self._retry(f"delete {self.uri(key)}/{MANIFEST_NAME}", self.fs.rm_file, self._path(key, MANIFEST_NAME))
        for rel in m.files:
            try:
                self._retry(f"delete {self.uri(key)}/{rel}", self.fs.rm_file, self._path(key, rel))
            except FileNotFoundError:
                pass

    def _write_manifest(self, key: str, data: bytes) -> None:
        final = self._path(key, MANIFEST_NAME)
        if self._local:  # rename is atomic on one filesystem: readers see no manifest or all of it
            tmp = f"{final}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        else:  # one PUT of a small object is atomic on S3
            self._retry(f"write {self.uri(key)}/{MANIFEST_NAME}", self.fs.pipe_file, final, data)


def _check_key(key: str) -> str:
    parts = key.split("/") if isinstance(key, str) else []
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[-1] == MANIFEST_NAME:
        raise ValueError(f"artifact key {key!r} is invalid: expected a relative path like "
                         "'runs/<run_id>/policy/v0003' without '.', '..', empty parts or a trailing "
                         f"{MANIFEST_NAME}")
    return key
