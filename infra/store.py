# longer than 400 lines: the ArtifactStore: verified reads, one-winner publish and the run lock share its helpers
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
  rollout's carry, which a rerun of its iteration replaces);
- one writer per key: a publisher first takes the key's lease (`<key>/.publishing/`, infra/leases.py),
  and the manifest is committed with an atomic create-if-absent, so of two processes publishing one
  key exactly one wins; the other waits for it and gets `ArtifactExists` (or, with identical files,
  the winner's manifest and a log line saying so);
- one run per run id: `lock_run` takes the run's lease (`runs/<run_id>/.lock/`), naming the holder
  when it is taken (`RunLocked`);
- verified reads: `verify` re-hashes a published version in place, `verify_dir` a version's folder
  on a local disk, `check_fetched` a fetched copy (against the stamp `fetch` wrote), and a corrupt
  version's error names the newest earlier version that verifies (`recovery_hint`);
- a write the disk or bucket refuses (full, over quota, read-only, not permitted) raises
  `StoreRefused`, naming the store, the path, the setting `run.store_uri` and the free space; a
  publish that ran out of room deletes its partial files.

Roots: a local folder (`/data/store`, `file:///data/store`) or `s3://bucket/prefix` through s3fs.
S3 endpoint and credentials come from `storage_options` (`endpoint_url`, `key`, `secret`) or the
standard env vars (`AWS_ENDPOINT_URL` / `FSSPEC_S3_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`); they are never logged or written anywhere. Every remote call retries
connection-type errors with exponential backoff, then raises `StoreUnavailable` naming the URI.
See docs/storage.md.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import logging
import os
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

import fsspec

from infra import leases, refusals
from infra.manifest import MANIFEST_NAME, FileEntry, Manifest, sha256_file

log = logging.getLogger(__name__)

STAMP_NAME = ".verified.json"  # beside a fetched copy: per file (sha256, size, inode, mtime_ns, ctime_ns) once verified
PUBLISHING = ".publishing"  # <key>/.publishing/<generation>: the lease of the process publishing `key`
LOCK_STALE_S = float(os.environ.get("FLYROLL_LOCK_STALE_S", "120"))  # another host's lease: stale after this
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


class StoreRefused(StoreError, OSError):
    """The disk or bucket refused a write: full (ENOSPC), over quota (EDQUOT), read-only (EROFS) or
    not permitted (EACCES, EPERM). The message names the store, the operation, the path and what to
    do; `errno` is the original error's (chained as the cause), `path` the path it names."""

    def __init__(self, message: str, code: int, path: str | None):
        super().__init__(message)
        self.errno, self.path = code, path


class RunLocked(StoreError):
    """Another live process holds the run's lock (`holder`: its lease record)."""

    def __init__(self, message: str, holder: dict[str, Any]):
        super().__init__(message)
        self.holder = holder


def run_lock_key(run_id: str) -> str:
    """The run lock's folder in the store: `runs/<run_id>/.lock` (leases as `<generation>` under it)."""
    return f"runs/{run_id}/.lock"


_RUN_LOCKS: dict[tuple[str, str], leases.Lease] = {}  # (store root, run id) -> the lease this process holds


def _stat_stamp(path: str) -> dict[str, int]:
    st = os.stat(path)
    return {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _read_stamp(local_dir: str, key: str) -> dict[str, dict]:
    try:
        with open(os.path.join(local_dir, STAMP_NAME)) as f:
            d = json.load(f)
        return d["files"] if d.get("key") == key and isinstance(d.get("files"), dict) else {}
    except (OSError, ValueError, KeyError, AttributeError):
        return {}


def _write_stamp(local_dir: str, key: str, entries: dict[str, FileEntry], merge: bool = True) -> None:
    """Record, for files of `key` just verified in `local_dir`, their sha256 and their stat stamp."""
    files = _read_stamp(local_dir, key) if merge else {}
    for rel, e in entries.items():
        files[rel] = {"sha256": e.sha256, **_stat_stamp(os.path.join(local_dir, *rel.split("/")))}
    tmp = os.path.join(local_dir, f"{STAMP_NAME}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        json.dump({"key": key, "files": files}, f, sort_keys=True)
    os.replace(tmp, os.path.join(local_dir, STAMP_NAME))


def _check_local(local_dir: str, key: str, entries: dict[str, "FileEntry"]) -> list[str]:
    """The files of `entries` that do not match in `local_dir`: a stamped file whose stat is unchanged
    is trusted, any other is re-hashed (and stamped again when it matches)."""
    stamp, bad, rehashed = _read_stamp(local_dir, key), [], {}
    for rel, want in sorted(entries.items()):
        lp = os.path.join(local_dir, *rel.split("/"))
        if not os.path.isfile(lp):
            bad.append(rel)
            continue
        s = stamp.get(rel)
        if s and s.get("sha256") == want.sha256 and s.get("size") == want.size and \
                {k: s.get(k) for k in ("size", "ino", "mtime_ns", "ctime_ns")} == _stat_stamp(lp):
            continue
        if os.path.getsize(lp) == want.size and sha256_file(lp) == want.sha256:
            rehashed[rel] = want
        else:
            bad.append(rel)
    if rehashed and not bad:
        _write_stamp(local_dir, key, rehashed)
    return bad




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
                 retries: int = 4, backoff_s: float = 0.5, publish_wait_s: float = 600.0):
        if not root:
            raise ValueError("ArtifactStore root is empty: expected a folder path, file:// or s3:// URI")
        self.root = root.rstrip("/") or "/"
        self.retries = retries
        self.backoff_s = backoff_s
        self.publish_wait_s = publish_wait_s  # how long a publisher waits for another one publishing the same key
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
                if refusals.refused_errno(e) is not None and not isinstance(e, StoreRefused):
                    raise self._refused(what, e) from e
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

    def _refused(self, what: str, e: OSError) -> StoreRefused:
        """`e` (a refused write, infra/refusals.py) as an error naming this store, the operation and the
        path, and what to do: on the store's side, point `run.store_uri` elsewhere; a local folder
        outside the store (a fetch's destination) is this machine's disk, not the store's."""
        code, path = refusals.refused_errno(e), refusals.refused_path(e)
        at, remedy = (f" at {path}" if path else ""), refusals.REFUSED[code][1]
        outside = bool(path) and os.path.isabs(path) and not (self._local and (path + "/").startswith(self._root_path + "/"))
        if outside:
            return StoreRefused(f"{what} failed{at}, a folder on this machine outside the artifact store {self.root}: "
                                f"{refusals.cause(code, path)}; {remedy} (a run's fetch cache is $FLYROLL_CACHE_DIR, "
                                "default ~/.cache/flyroll)", code, path)
        if not self._local and code in (errno.EACCES, errno.EPERM):
            remedy = "give its credentials (storage_options, AWS_ACCESS_KEY_ID) write access to that bucket and prefix"
        return StoreRefused(
            f"artifact store {self.root}: {what} failed{at}: {refusals.cause(code, path if self._local else None)}; "
            f"{remedy}, or point the setting run.store_uri (or FLYROLL_STORE_URI) at another store. Versions already "
            f"published there are unchanged: a version exists only once its {MANIFEST_NAME} is written, and the next "
            "attempt publishes an interrupted one again", code, path)

    def check_writable(self) -> None:
        """Write and delete a small probe object under the root (the folder is created if need be), so a
        read-only or unreachable store fails at the start of a run, not at its first publish. Raises
        StoreError naming the root and the cause."""
        probe = f"{self._root_path}/.write-probe-{uuid.uuid4().hex}"
        try:
            self._retry(f"write {self.root}", self.fs.pipe_file, probe, b"flyroll write probe")
            self._retry(f"delete {self.root}", self.fs.rm_file, probe)
        except StoreRefused as e:  # already names the cause and what to do
            raise StoreRefused(f"artifact store {self.root} is not writable: {str(e).removeprefix(f'artifact store {self.root}: ')}",
                               e.errno, e.path) from e.__cause__
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
              include: tuple[str, ...] | None = None, stamp: bool = False) -> str:
        """Download every file of a version into local_dir and check it against the manifest;
        `skip`: leave out the files whose relative path starts with one of these; `include`: only
        the files whose relative path starts with one of these (None: all); `stamp`: record the
        verified files' stat stamps in local_dir/.verified.json, for `check_fetched` (a cache)."""
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
                        f"(size {size} vs {want.size}, or sha256 differs from {want.sha256[:12]}...)"
                        + self.recovery_hint(key))
            if stamp:
                _write_stamp(local_dir, key, {rel: m.files[rel] for rel in rels})
        return local_dir

    def check_fetched(self, key: str, local_dir: str, skip: tuple[str, ...] = ()) -> list[str]:
        """The files of a copy `fetch` made of `key` in `local_dir` (those not under `skip`) that no
        longer match the version's manifest: [] when all do. A file whose (size, inode, mtime_ns,
        ctime_ns) is what `fetch` stamped after verifying it is not read again (any write, rename or
        `os.utime` changes its ctime, which no user call can set back); any other is re-hashed."""
        m = self.manifest(key)
        return _check_local(local_dir, key, {r: e for r, e in m.files.items() if not r.startswith(tuple(skip))})

    def verify(self, key: str) -> Manifest:
        """Re-hash every file of published version `key` in the store (streamed, nothing kept);
        raise `CorruptArtifact` naming the first bad file and the newest earlier version that verifies."""
        m = self.manifest(key)
        for rel, want in sorted(m.files.items()):
            problem = self._stored_mismatch(key, rel, want)
            if problem:
                raise CorruptArtifact(f"artifact {self.uri(key)}: {problem}" + self.recovery_hint(key))
        return m

    def _stored_mismatch(self, key: str, rel: str, want: FileEntry) -> str | None:
        h, size = hashlib.sha256(), 0
        try:
            with self._retry(f"open {self.uri(key)}/{rel}", self.fs.open, self._path(key, rel), "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
        except FileNotFoundError:
            return f"file {rel!r} its manifest lists is missing"
        if size != want.size or h.hexdigest() != want.sha256:
            return (f"file {rel!r} does not match its manifest (size {size} vs {want.size}, "
                    f"sha256 {h.hexdigest()[:12]}... vs {want.sha256[:12]}...)")
        return None

    def recovery_hint(self, key: str, max_checked: int = 8) -> str:
        """For a corrupt version `key` of a numbered series (`.../v0003`): which earlier version to go
        back to -- the newest one whose files all verify (up to `max_checked` are re-hashed) -- and how."""
        series, _, name = key.rpartition("/")
        if not (series and name[:1] == "v" and name[1:].isdigit()):
            return ""
        try:
            older = [k for k in self.list(series) if k.rpartition("/")[2] < name][::-1]
        except StoreError:
            return ""
        for k in older[:max_checked]:
            try:
                m = self.manifest(k)
                if any(self._stored_mismatch(k, rel, e) for rel, e in m.files.items()):
                    continue
            except StoreError:
                continue
            return (f". Never train from it: the newest earlier version whose hashes verify is {k}; to resume "
                    f"from it, delete the corrupt version's manifest ({self.uri(key)}/{MANIFEST_NAME}) and those of "
                    f"the versions after it, then rerun (a run resumes from its newest version)")
        return (f". Never train from it: none of the {min(len(older), max_checked)} earlier versions of {series} checked "
                "verifies; start the run anew (--restart)")

    @staticmethod
    def verify_dir(local_dir: str) -> Manifest | None:
        """Check a version's folder on a local disk (a local store's `<root>/<key>`, holding its
        MANIFEST.json) against its manifest: every listed file there with its size and sha256. None when
        the folder holds no manifest (not a store version); raises `CorruptArtifact` naming the file."""
        path = os.path.join(local_dir, MANIFEST_NAME)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, "rb") as f:
                m = Manifest.from_json(f.read())
        except ValueError as e:
            raise CorruptArtifact(f"manifest {path} is unreadable: {e}") from e
        for rel, want in sorted(m.files.items()):
            lp = os.path.join(local_dir, *rel.split("/"))
            size = os.path.getsize(lp) if os.path.isfile(lp) else -1
            if size != want.size or sha256_file(lp) != want.sha256:
                store = ArtifactStore(local_dir[: -len(m.key)].rstrip("/")) if \
                    local_dir.rstrip("/").endswith("/" + m.key) else None
                raise CorruptArtifact(f"artifact version {m.key!r} at {local_dir}: file {rel!r} does not match its "
                                      f"manifest (size {size} vs {want.size}, or sha256 differs from {want.sha256[:12]}...)"
                                      + (store.recovery_hint(m.key) if store else ""))
        return m

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

        existing = self._published(key, entries, kind)
        if existing is not None:
            return existing
        # one writer per key: the key's lease, then the files, then the manifest (create-if-absent)
        lease = leases.Lease(self.fs, self._path(key, PUBLISHING), self._local, f"publishing {key}",
                             stale_after_s=LOCK_STALE_S, heartbeat_s=min(10.0, LOCK_STALE_S / 6),
                             info={"execution_id": execution_id or ""}, retry=self._retry)
        deadline, delay = time.monotonic() + self.publish_wait_s, 0.05
        while (holder := lease.try_acquire()) is not None:  # another process is publishing it: wait for it
            if time.monotonic() > deadline:
                raise ArtifactExists(f"artifact version {self.uri(key)} is being published by another process "
                                     f"({leases.describe(holder)}) for more than {self.publish_wait_s:.0f}s")
            time.sleep(delay)
            delay = min(1.0, delay * 2)
            existing = self._published(key, entries, kind, other_writer=True)
            if existing is not None:
                return existing
        failed = False
        try:
            lease.start_heartbeat()
            existing = self._published(key, entries, kind, other_writer=True)  # finished while we took the lease
            if existing is not None:
                return existing
            rels = list(files)
            self._retry(f"upload to {self.uri(key)}", self.fs.put, [files[r] for r in rels],
                        [self._path(key, r) for r in rels])
            remote = self._retry(f"list {self.uri(key)}", self.fs.find, self._path(key), detail=True)
            for rel in rels:
                got = remote.get(self._path(key, rel), {}).get("size")
                if got != entries[rel].size:
                    raise StoreUnavailable(f"upload of {self.uri(key)}/{rel} is incomplete: "
                                           f"{got} bytes stored, {entries[rel].size} expected")
            if not lease.held():
                raise StoreError(f"publish {self.uri(key)}: lost the key's lease while uploading (this process stalled "
                                 f"for more than {LOCK_STALE_S:.0f}s and another took over); nothing was committed")
            m = Manifest(key=key, kind=kind, files=entries, parents=list(parents), producer=producer,
                         execution_id=execution_id, created_at=datetime.now(timezone.utc).isoformat(),
                         metadata=metadata)
            if not self._retry(f"write {self.uri(key)}/{MANIFEST_NAME}", leases.create_exclusive, self.fs,
                               self._path(key, MANIFEST_NAME), m.to_json().encode(), self._local):
                existing = self._published(key, entries, kind, other_writer=True)  # never overwrites a version
                if existing is not None:
                    return existing
                self._write_manifest(key, m.to_json().encode())  # over an unreadable one (no version): we hold the lease
        except BaseException as e:
            failed = True
            if isinstance(e, StoreRefused) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._take_back(key, list(files))  # the partial files would keep the disk full
            try:  # the store may be what failed: one attempt, and the error to raise is the one that stopped the publish
                lease._retry = lambda what, fn, *a, **k: fn(*a, **k)
                lease.release()
            except Exception as e:  # noqa: BLE001 -- logged; a claim left behind is taken over as stale
                log.warning("store: publish %s failed; its lease could not be released either (%s)", self.uri(key), e)
            raise
        finally:
            if not failed:
                lease.release()
        log.info("store: published %s (%s, %d files)", self.uri(key), kind, len(entries))
        return m

    def _take_back(self, key: str, rels: list[str]) -> None:
        """Delete the files a publish of `key` that ran out of room uploaded (no version: it holds the
        key's lease and no manifest was committed), one attempt each, so the failed publish does not
        leave the disk full."""
        try:
            if self.exists(key):
                return
            for rel in rels:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self._path(key, rel))
        except Exception as e:  # noqa: BLE001 -- the error to raise is the refusal; what is left is debris the next publish overwrites
            log.warning("store: publish %s ran out of room; its partial files could not all be deleted (%s)", self.uri(key), e)

    def _published(self, key: str, entries: dict[str, FileEntry], kind: str, other_writer: bool = False) -> Manifest | None:
        """The committed manifest of `key` when it holds exactly `entries` (a no-op publish), None when
        `key` is not published (no manifest, or an unreadable one); `ArtifactExists` when it holds other files."""
        try:
            old = self.manifest(key)
        except (ArtifactNotFound, CorruptArtifact):  # an unreadable manifest is debris, not a version
            return None
        by = f" by {old.producer or '?'} (execution {old.execution_id or 'none'}) at {old.created_at}"
        if old.files == entries and old.kind == kind:
            log.info("store: %s already published with identical files%s, keeping it (nothing uploaded)",
                     self.uri(key), by if other_writer else "")
            return old
        raise ArtifactExists(f"artifact version {self.uri(key)} is already published{by} with different content"
                             f"{' (another process published it while this one waited)' if other_writer else ''}; "
                             "versions are immutable, publish under a new key")

    # -- the run lock ------------------------------------------------------------------------

    def lock_run(self, run_id: str, *, execution_id: str = "", stale_after_s: float | None = None,
                 heartbeat_s: float | None = None) -> leases.Lease:
        """Take run `run_id`'s lock (`run_lock_key`) in the store, or raise `RunLocked` naming the live
        holder. Re-entrant within a process. A daemon thread heartbeats it; it is released by
        `unlock_run`, at the process's exit, or -- after a kill -- taken over by the next run by the
        rule of infra/leases.py (same host: the holder's pid is gone; another host: no heartbeat for
        `stale_after_s`, default FLYROLL_LOCK_STALE_S or 120 s)."""
        held = _RUN_LOCKS.get((self.root, run_id))
        if held is not None and held.held():
            return held
        stale = LOCK_STALE_S if stale_after_s is None else stale_after_s
        lease = leases.Lease(self.fs, self._path(run_lock_key(run_id)), self._local, f"run {run_id}", stale_after_s=stale,
                             heartbeat_s=heartbeat_s or max(0.5, stale / 6), reentrant=True,
                             info={"execution_id": execution_id}, retry=self._retry)
        holder = lease.try_acquire()
        if holder is not None:
            raise RunLocked(f"run {run_id!r} is already running: its lock {self.uri(run_lock_key(run_id))} is held by "
                            f"{leases.describe(holder)}. Wait for it or stop it; a holder whose process is gone is taken "
                            f"over at once on its own host, and from another host once its heartbeat is older than "
                            f"{stale:.0f}s (FLYROLL_LOCK_STALE_S)", holder)
        if lease.took_over:
            log.warning("store: run %s: took over the lock of a stale holder (%s)", run_id, lease.took_over)
        lease.start_heartbeat()
        _RUN_LOCKS[(self.root, run_id)] = lease
        atexit.register(lease.release)
        return lease

    def unlock_run(self, run_id: str) -> bool:
        """Release run `run_id`'s lock if this process holds it; False when it does not."""
        lease = _RUN_LOCKS.pop((self.root, run_id), None)
        return bool(lease and lease.release())

    def run_lock_holder(self, run_id: str) -> dict[str, Any] | None:
        """The lease record of run `run_id`'s lock holder, None when unlocked."""
        return leases.Lease(self.fs, self._path(run_lock_key(run_id)), self._local, f"run {run_id}",
                            stale_after_s=LOCK_STALE_S, heartbeat_s=LOCK_STALE_S, retry=self._retry).holder()

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
        (tasks/loop/partial_rollout.py); checkpoints and rollout tables are never deleted."""
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
            self._retry(f"write {self.uri(key)}/{MANIFEST_NAME}", leases.overwrite, None, final, data, True)
        else:  # one PUT of a small object is atomic on S3
            self._retry(f"write {self.uri(key)}/{MANIFEST_NAME}", self.fs.pipe_file, final, data)


def _check_key(key: str) -> str:
    parts = key.split("/") if isinstance(key, str) else []
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[-1] == MANIFEST_NAME:
        raise ValueError(f"artifact key {key!r} is invalid: expected a relative path like "
                         "'runs/<run_id>/policy/v0003' without '.', '..', empty parts or a trailing "
                         f"{MANIFEST_NAME}")
    return key
