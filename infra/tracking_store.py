"""A SQLite MLflow tracking store (a local run's `<run.output_dir>/mlflow.db`) that cannot be used --
read-only, corrupt or truncated, locked, on a full disk -- as an error naming the file, what is wrong
and what to do (`store_problem`; infra/tracking.py's `client` is a `CheckedClient`, whose every call
applies it), and the check `prepare_run` makes before a run touches it (`check_store`). Nothing here
changes the file."""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import uuid

from infra import refusals


def tracking_uri_source(configured: str | None) -> str:
    """Which setting infra/tracking.py `resolve_tracking_uri` takes the URI from, for error messages."""
    if configured:
        return "the setting run.tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "the env var MLFLOW_TRACKING_URI"
    return "the default <run.output_dir>/mlflow.db (neither run.tracking_uri nor MLFLOW_TRACKING_URI is set)"


class TrackingStoreError(RuntimeError):
    """The MLflow tracking store cannot be used: a SQLite file that is read-only, corrupt, locked or on
    a full disk. The message names the file, what is wrong and what to do; the SQLite error is chained."""


# what SQLite says -> (what is wrong, what to do); {path}, {uid}, {free}, {where} are filled in
_SQLITE_PROBLEMS = (
    (("readonly database",), "it is read-only for this process",
     "make the file, its folder (SQLite writes a journal beside it) and its filesystem writable for this user (uid {uid}), "
     "or {where}"),
    (("unable to open database file",), "SQLite cannot open it",
     "make its folder exist and be readable and writable for this user (uid {uid}), or {where}"),
    (("file is not a database", "database disk image is malformed"), "it is not an intact SQLite database (damaged or truncated)",
     "keep it (MLflow's runs are in it) and move it aside (mv {path} {path}.corrupt): the next run starts a new tracking "
     "store there and resumes from the artifact store, in a new MLflow run; or put back a copy from a backup; or {where}"),
    (("database is locked",), "it is locked: another process has held a write lock on it for too long",
     "find the process holding it (an `mlflow ui` or `mlflow server` on this file, another run sharing it) and wait for "
     "it or stop it; runs at the same time belong on a tracking server (flyroll stack up, then MLFLOW_TRACKING_URI), "
     "or {where}"),
    (("database or disk is full",), "the disk holding it is full", "free space there{free}, or {where}"),
    (("disk i/o error",), "its filesystem reported an I/O error", "check the disk, or {where}"),
)


def sqlite_path(tracking_uri: str) -> str | None:
    """The file of a `sqlite:///` tracking URI (`sqlite:////abs/mlflow.db` -> /abs/mlflow.db), else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return tracking_uri[len("sqlite:///"):].split("?", 1)[0]


def store_problem(e: BaseException, tracking_uri: str, source: str = "") -> TrackingStoreError | None:
    """`e` (raised by SQLite, SQLAlchemy or MLflow on a `sqlite:` store) as an error naming the file,
    what is wrong and what to do, or None when it is not one of those problems (or not a SQLite store)."""
    path = sqlite_path(tracking_uri)
    if path is None:
        return None
    seen, chain = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    texts = [str(x).lower() for x in chain]
    for says, wrong, todo in _SQLITE_PROBLEMS:
        said = next((s for s in says if any(s in t for t in texts)), None)
        if said is None:
            continue
        where = ("point the tracking store elsewhere: set run.tracking_uri (or MLFLOW_TRACKING_URI) to another "
                 f"sqlite:/// file or a tracking server{f'; this one is {source}' if source else ''}")
        room = refusals.free_space(path)
        todo = todo.format(path=path, uid=os.getuid(), where=where, free=f" ({room} on that filesystem)" if room else "")
        sqlite_said = next((str(x) for x in chain if type(x).__module__ == "sqlite3" and said in str(x).lower()), said)
        return TrackingStoreError(f"MLflow tracking store {tracking_uri} (file {os.path.abspath(path)}): {wrong} "
                                  f"(SQLite: {sqlite_said}). To go on, {todo}. flyroll changed nothing in it.")
    return None


def check_store(tracking_uri: str, source: str = "", lock_wait_s: float = 20.0) -> None:
    """Before a run touches it: a SQLite tracking store that exists must read intact (`PRAGMA
    quick_check`) and take a write (a table created in a transaction that is rolled back: nothing in it
    changes), and MLflow must open it; else `TrackingStoreError` naming the file, what is wrong and what
    to do (`source`: which setting named it, `tracking_uri_source`). A tracking server is not probed.
    quick_check reads the whole file: 0.16 s for 139 MiB from the page cache."""
    path = sqlite_path(tracking_uri)
    if path is None:
        return
    if os.path.exists(path):
        try:
            con = sqlite3.connect(path, timeout=lock_wait_s, isolation_level=None)
            try:
                rows = con.execute("PRAGMA quick_check").fetchall()
                if rows != [("ok",)]:
                    raise sqlite3.DatabaseError("database disk image is malformed: " + "; ".join(str(r[0]) for r in rows[:3]))
                con.execute("BEGIN IMMEDIATE")
                try:
                    con.execute(f"CREATE TABLE flyroll_write_probe_{uuid.uuid4().hex} (x INTEGER)")
                finally:
                    with contextlib.suppress(sqlite3.Error):
                        con.execute("ROLLBACK")
            finally:
                con.close()
        except sqlite3.Error as e:
            raise (store_problem(e, tracking_uri, source) or e) from e
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow.tracking import MlflowClient

    checked_call(tracking_uri, source, MlflowClient, tracking_uri=tracking_uri)  # MLflow opens it (a new file: creates its tables)


def checked_call(tracking_uri: str, source: str, fn, /, *args, **kwargs):
    """`fn(*args, **kwargs)`, a call into MLflow's store at `tracking_uri`, with a SQLite failure raised
    as `TrackingStoreError` (`store_problem`; `source`: which setting named the store, or ""); any
    other error as it was."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        problem = store_problem(e, tracking_uri, source)
        if problem is None:
            raise
        raise problem from e


class CheckedClient:
    """An MlflowClient whose methods go through `checked_call` (infra/tracking.py `client`)."""

    def __init__(self, c, tracking_uri: str):
        self._c, self._uri = c, tracking_uri

    def __getattr__(self, name: str):
        attr = getattr(self._c, name)
        if not callable(attr):
            return attr
        return functools.wraps(attr)(functools.partial(checked_call, self._uri, "", attr))
