"""A SQLite MLflow store (a local run's mlflow.db) that cannot be used -- corrupt, truncated,
read-only by permission or by filesystem, locked, on a full disk -- is named with what is wrong and
what to do, by `prepare_run` before the run touches it and by every call of `tracking.client`, and
the file is left byte for byte as it was (issue 60). Before, each was a SQLAlchemy traceback naming
neither the file nor a setting.

The databases are real (written by MLflow), and so are the refusals: a read-only mount, a folder the
child's user may not write and a full tmpfs, in the namespaces of a child process (tests/support/folders.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import sys

import pytest

from infra import tracking
from infra.tracking_store import TrackingStoreError, check_store
from tests.support.folders import in_namespace, open_folder, user_home  # noqa: F401  (open_folder: a fixture)
from tests.support.workflow import REPO


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory) -> str:
    """An MLflow SQLite store with an experiment and a finished run in it."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    uri = f"sqlite:///{path}"
    run = tracking.start_parent_run(uri, "exp", "r", {"a": "1"}, {"flyroll.run_id": "r"})
    tracking.end_run(uri, run)
    return str(path)


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _copy(db: str, folder) -> str:
    os.makedirs(folder, exist_ok=True)
    return shutil.copy(db, os.path.join(folder, "mlflow.db"))


def test_a_corrupt_mlflow_db_stops_prepare_run_naming_the_file_and_what_to_do(tmp_path, mlflow_db):
    """The run's default store, <run.output_dir>/mlflow.db, its first page overwritten."""
    from tasks.stages.prepare import prepare_run
    from tests.support.datasets import _config

    db = _copy(mlflow_db, tmp_path / "runs")
    with open(db, "r+b") as f:
        f.write(b"not a database, a stray write " * 4)
    before = _sha(db)
    with pytest.raises(TrackingStoreError) as e:
        prepare_run(config=_config(tmp_path), restart=False)
    msg = str(e.value)
    assert (f"MLflow tracking store sqlite:///{db} (file {db}): it is not an intact SQLite database "
            "(damaged or truncated) (SQLite: file is not a database)") in msg, msg
    assert f"mv {db} {db}.corrupt" in msg and "run.tracking_uri (or MLFLOW_TRACKING_URI)" in msg
    assert "this one is the default <run.output_dir>/mlflow.db" in msg
    assert _sha(db) == before
    assert [f for f in os.listdir(tmp_path / "runs") if f.startswith("mlflow")] == ["mlflow.db"]  # no journal, nothing moved


def test_a_truncated_mlflow_db_is_named_by_the_check_and_by_every_client_call(tmp_path, mlflow_db):
    db = _copy(mlflow_db, tmp_path)
    os.truncate(db, os.path.getsize(db) // 3)
    before, uri = _sha(db), f"sqlite:///{db}"
    with pytest.raises(TrackingStoreError, match=r"not an intact SQLite database .*SQLite: database disk image is malformed") as e:
        check_store(uri, "the setting run.tracking_uri")
    assert "this one is the setting run.tracking_uri" in str(e.value)
    with pytest.raises(TrackingStoreError, match=rf"MLflow tracking store {uri} .*mv {db} {db}.corrupt") as e:
        tracking.client(uri).search_experiments()
    assert isinstance(e.value.__cause__, Exception)  # the SQLAlchemy error, chained
    assert _sha(db) == before


def test_a_locked_mlflow_db_is_named(tmp_path, mlflow_db):
    db = _copy(mlflow_db, tmp_path)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing (an `mlflow server`, another run)
    try:
        with pytest.raises(TrackingStoreError, match=r"it is locked: .*SQLite: database is locked.*flyroll stack up"):
            check_store(f"sqlite:///{db}", lock_wait_s=0.2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    check_store(f"sqlite:///{db}")  # free again: passes, nothing changed
    assert _sha(db) == _sha(mlflow_db)


# in the child: the check, then a write through tracking.client; one JSON line each
CHECK = """
import json, sys
from infra import tracking
from infra.tracking_store import TrackingStoreError, check_store
uri = "sqlite:///" + sys.argv[1]
for call in (lambda: check_store(uri, "the setting run.tracking_uri"), lambda: tracking.client(uri).create_experiment("new")):
    try:
        call()
        print(json.dumps({"ok": True}), flush=True)
    except TrackingStoreError as e:
        print(json.dumps({"message": str(e)}), flush=True)
"""


def _check_in(kind: str, db: str, work, shell_before: str = "", env: dict | None = None) -> list[dict]:
    script = os.path.join(work, "check.py")
    with open(script, "w") as f:
        f.write(CHECK)
    proc = in_namespace(kind, f"{shell_before}{sys.executable} {script} {db}",
                        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 2, proc.stderr[-3000:]
    return lines


def test_an_mlflow_db_on_a_read_only_filesystem_is_named(tmp_path, mlflow_db):
    db = _copy(mlflow_db, tmp_path / "ro")
    checked, written = _check_in("mounts", db, tmp_path, f"mount --bind {tmp_path / 'ro'} {tmp_path / 'ro'} && "
                                                         f"mount -o remount,bind,ro {tmp_path / 'ro'} && ")
    for result in (checked, written):
        assert result["message"].startswith(f"MLflow tracking store sqlite:///{db} (file {db}): it is read-only for this "
                                            "process (SQLite: attempt to write a readonly database)"), result
        assert "make the file, its folder" in result["message"] and "run.tracking_uri (or MLFLOW_TRACKING_URI)" in result["message"]
    assert "this one is the setting run.tracking_uri" in checked["message"]
    assert _sha(db) == _sha(mlflow_db)


def test_an_mlflow_db_this_user_may_not_write_is_named(open_folder, mlflow_db):
    db = _copy(mlflow_db, open_folder / "runs")
    os.chmod(db, 0o444)
    os.chmod(open_folder / "runs", 0o555)
    checked, written = _check_in("unprivileged", db, open_folder, env={"HOME": user_home(open_folder)})
    for result in (checked, written):
        assert "it is read-only for this process (SQLite: attempt to write a readonly database)" in result["message"], result
        assert f"(file {db})" in result["message"]
    assert _sha(db) == _sha(mlflow_db)


def test_an_mlflow_db_on_a_full_disk_is_named_with_the_free_space(tmp_path, mlflow_db):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    db = str(mnt / "mlflow.db")
    checked, written = _check_in("mounts", db, tmp_path, f"mount -t tmpfs -o size=2m tmpfs {mnt} && cp {mlflow_db} {db} && "
                                                         f"(dd if=/dev/zero of={mnt}/filler bs=4k 2>/dev/null; true) && ")
    for result in (checked, written):
        assert "the disk holding it is full (SQLite: database or disk is full)" in result["message"], result
        assert "free space there (0 B free of 2.0 MiB on that filesystem)" in result["message"]


def test_a_tracking_server_uri_is_not_probed():
    check_store("http://127.0.0.1:9/")  # nothing listens there: a server is not a file to check
