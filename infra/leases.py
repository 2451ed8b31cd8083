"""Leases held in the object store: one holder at a time of a name (a run, a version being
published), on a local disk or on S3, across processes and machines.

A lease on prefix P is a small JSON object `P/<generation>` (ten digits) saying who holds it:
host, pid, the process's start time, the Flyte execution, when it was taken and its last
heartbeat. It is taken with an atomic create-if-absent of the next generation -- `os.link` of a
fully written temp file on a local disk, a PUT with `If-None-Match: *` on S3 (AWS, SeaweedFS,
MinIO) -- so of two processes racing for it exactly one gets it. The holder rewrites its object
every `heartbeat_s` and deletes it on release.

The rule for a holder that died without releasing (docs/storage.md):
- on the same host (hostname and PID namespace): stale as soon as its pid is gone, or the pid now
  belongs to another process (its start time differs);
- on another host: stale once its heartbeat is older than `stale_after_s`.
A stale lease is taken over by creating the next generation (create-if-absent again: of two
processes taking over the same stale lease, one wins); the holder is always the newest generation,
and older ones are deleted by whoever takes over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

log = logging.getLogger(__name__)

_GEN_DIGITS = 10


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


HOST = socket.gethostname()
PID_NAMESPACE = _pid_namespace()


def process_started(pid: int) -> str:
    """The start time of process `pid` (clock ticks since boot, Linux), "" if unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


_LIVE_TOKENS: set[str] = set()  # tokens of the leases this process holds (taken and not released)


def stale_reason(holder: dict[str, Any], stale_after_s: float, now: float | None = None) -> str | None:
    """Why the lease record `holder` is stale (its holder died), or None while it is live."""
    now = time.time() if now is None else now
    if holder.get("host") == HOST and holder.get("pid_namespace", "") == PID_NAMESPACE:
        pid = int(holder.get("pid", -1))
        if pid <= 0 or not pid_alive(pid):
            return f"its process {pid} on this host ({HOST}) is gone"
        started = process_started(pid)
        if holder.get("pid_started") and started and started != holder["pid_started"]:
            return f"its process {pid} on this host ({HOST}) is gone (the pid now belongs to another process)"
        return None
    age = now - float(holder.get("heartbeat_at", 0))
    if age > stale_after_s:
        return f"no heartbeat from host {holder.get('host')!r} for {age:.0f}s (> {stale_after_s:.0f}s)"
    return None


def describe(holder: dict[str, Any], now: float | None = None) -> str:
    """One line naming a lease's holder, for error messages."""
    now = time.time() if now is None else now
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started_at", 0))))
    execution = holder.get("execution_id") or "none"
    return (f"host {holder.get('host')!r} pid {holder.get('pid')} (Flyte execution {execution}) since {started}, "
            f"last heartbeat {now - float(holder.get('heartbeat_at', 0)):.0f}s ago")


def create_exclusive(fs, path: str, data: bytes, local: bool) -> bool:
    """Create object `path` holding `data` unless it exists, atomically: True if this call created it.
    A reader sees no object or all of `data`."""
    if local:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # fails if `path` exists, on every POSIX filesystem (O_EXCL has no content)
            return True
        except FileExistsError:
            return False
        finally:  # also after a failed write (a full disk): no temp file left behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    try:
        fs.pipe_file(path, data, mode="create")  # PUT with If-None-Match: *
    except OSError as e:
        if "pre-condition" in str(e).lower() or "precondition" in str(e).lower() or "412" in str(e):
            return False
        raise
    return True


def overwrite(fs, path: str, data: bytes, local: bool) -> None:
    """Replace object `path` with `data` atomically (temp file, fsynced, renamed over it; one PUT on S3). A
    failed local write leaves `path` as it was and no temp file behind."""
    if local:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    else:
        fs.pipe_file(path, data)


class Lease:
    """A lease on `prefix` (a path in `fs`); `try_acquire`, then `release` (or let the process die).

    what:          what is held, for messages ("run r1", "publishing runs/r1/policy/v0003")
    stale_after_s: a holder on another host is stale once its heartbeat is this old
    heartbeat_s:   how often `start_heartbeat`'s thread rewrites the record
    reentrant:     the same process may take it again (the run lock: prepare_run called twice in a process)
    info:          extra fields of the record (the Flyte execution id)
    retry:         wraps each store call (ArtifactStore._retry: transient errors are retried)
    """

    def __init__(self, fs, prefix: str, local: bool, what: str, stale_after_s: float, heartbeat_s: float,
                 reentrant: bool = False, info: dict[str, Any] | None = None,
                 retry: Callable[..., Any] | None = None):
        self.fs, self.prefix, self.local, self.what = fs, prefix.rstrip("/"), local, what
        self.stale_after_s, self.heartbeat_s, self.reentrant = stale_after_s, heartbeat_s, reentrant
        self.info = dict(info or {})
        self._retry = retry or (lambda what, fn, *a, **k: fn(*a, **k))
        self.token = uuid.uuid4().hex
        self.generation: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: str | None = None  # why the previous holder was stale, when this one took over

    def _path(self, generation: int) -> str:
        return f"{self.prefix}/{generation:0{_GEN_DIGITS}d}"

    def _generations(self) -> list[int]:
        try:
            found = self._retry(f"list {self.prefix}", self.fs.ls, self.prefix, detail=False)
        except FileNotFoundError:
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in found]
        return sorted(int(n) for n in names if n.isdigit() and len(n) == _GEN_DIGITS)

    def _read(self, generation: int) -> dict[str, Any] | None:
        try:
            raw = self._retry(f"read {self._path(generation)}", self.fs.cat_file, self._path(generation))
        except FileNotFoundError:
            return None
        try:
            rec = json.loads(raw)
            return rec if isinstance(rec, dict) else {}
        except ValueError:
            return {}  # unreadable: no host, no heartbeat -> stale

    def _record(self, started_at: float | None = None) -> bytes:
        now = time.time()
        return json.dumps({"what": self.what, "token": self.token, "host": HOST, "pid_namespace": PID_NAMESPACE,
                           "pid": os.getpid(), "pid_started": process_started(os.getpid()),
                           "started_at": started_at or now, "heartbeat_at": now, **self.info}).encode()

    def holder(self) -> dict[str, Any] | None:
        """The record of the current (newest) holder, None when nobody holds it."""
        gens = self._generations()
        return self._read(gens[-1]) if gens else None

    def try_acquire(self) -> dict[str, Any] | None:
        """Take the lease: None when this process holds it now, else the live holder's record."""
        for _ in range(20):
            gens = self._generations()
            if not gens:
                n = 0
            else:
                rec = self._read(gens[-1])
                if rec is None:  # released while we looked
                    continue
                if rec.get("token") == self.token:
                    return None
                same_process = (rec.get("host") == HOST and rec.get("pid_namespace", "") == PID_NAMESPACE
                                and rec.get("pid") == os.getpid() and rec.get("pid_started") == process_started(os.getpid()))
                if same_process and self.reentrant:
                    self.token, self.generation = rec["token"], gens[-1]
                    return None
                reason = stale_reason(rec, self.stale_after_s)
                if reason is None and same_process and rec.get("token") not in _LIVE_TOKENS:
                    reason = "this process released it but could not delete its record (the store failed then)"
                if reason is None:
                    return rec
                self.took_over = reason
                n = gens[-1] + 1
            if self._retry(f"create {self._path(n)}", create_exclusive, self.fs, self._path(n), self._record(), self.local):
                self.generation = n
                _LIVE_TOKENS.add(self.token)
                if self.took_over:
                    log.warning("lease %s (%s): took over from a stale holder: %s", self.prefix, self.what, self.took_over)
                for old in gens:  # the holder is the newest generation; older ones are debris
                    try:
                        self.fs.rm_file(self._path(old))
                    except FileNotFoundError:
                        pass
                return None
        raise RuntimeError(f"lease {self.prefix}: could not take or read it after 20 attempts")

    def held(self) -> bool:
        """Does this process still hold it (its generation is the newest, with its token)?"""
        if self.generation is None:
            return False
        gens = self._generations()
        return bool(gens) and gens[-1] == self.generation and (self._read(self.generation) or {}).get("token") == self.token

    def heartbeat(self) -> bool:
        """Rewrite the record with a new heartbeat time; False (and nothing written) when lost."""
        rec = self._read(self.generation) if self.generation is not None else None
        if not rec or rec.get("token") != self.token:
            return False
        self._retry(f"heartbeat {self._path(self.generation)}", overwrite, self.fs, self._path(self.generation),
                    self._record(started_at=rec.get("started_at")), self.local)
        return True

    def start_heartbeat(self) -> None:
        if self._thread is not None:
            return

        def beat():
            while not self._stop.wait(self.heartbeat_s):
                try:
                    if not self.heartbeat():
                        log.error("lease %s (%s): lost (another process took it over)", self.prefix, self.what)
                        return
                except Exception as e:  # noqa: BLE001 -- a missed beat is retried at the next one
                    log.warning("lease %s: heartbeat failed (%s: %s)", self.prefix, type(e).__name__, e)

        self._thread = threading.Thread(target=beat, name=f"lease-heartbeat {self.what}", daemon=True)
        self._thread.start()

    def release(self) -> bool:
        """Stop the heartbeat and delete this holder's record; False when it was not held (any more)."""
        self._stop.set()
        _LIVE_TOKENS.discard(self.token)  # released even if the delete below fails: `try_acquire` then takes it over
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.generation is None:
            return False
        rec = self._read(self.generation)
        generation, self.generation = self.generation, None
        if not rec or rec.get("token") != self.token:
            return False
        try:
            self._retry(f"delete {self._path(generation)}", self.fs.rm_file, self._path(generation))
        except FileNotFoundError:
            return False
        return True
