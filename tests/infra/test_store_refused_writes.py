"""A write the artifact store's disk refuses -- full (ENOSPC), read-only (EROFS), not this user's
(EACCES) -- raises `StoreRefused` naming the store, the path, the setting run.store_uri and (full
disk) the free space, with the OS error chained; versions already published stay intact (issue 60).
Before, each was a bare OSError naming neither the store nor the setting.

The refusals are real, from the kernel: a 256 KiB tmpfs, a tmpfs remounted read-only, a folder the
child's user may not write, each in the namespaces of a child process (tests/support/folders.py)."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path

from infra.store import ArtifactStore
from tests.support.folders import in_namespace, open_folder, user_home  # noqa: F401  (open_folder: a fixture)
from tests.support.workflow import REPO

V1, V2 = "runs/r1/policy/v0001", "runs/r1/policy/v0002"

# one step in the child process: `publish ROOT SRC KEY`, `fetch ROOT KEY DEST` or `state ROOT KEY_KEPT KEY_FAILED`;
# prints one JSON line
STEP = """
import json, os, sys
from infra.store import ArtifactStore
op, root, *args = sys.argv[1:]
store, out = ArtifactStore(root), {"op": op}
if op == "state":
    kept, failed = args
    store.verify(kept)
    folder = os.path.join(store._root_path, failed)
    out.update(kept_verifies=True, failed_exists=store.exists(failed),
               left=sorted(f for _, _, fs in os.walk(folder) for f in fs) if os.path.isdir(folder) else [])
else:
    try:
        store.publish(args[0], args[1], kind="checkpoint", producer="test") if op == "publish" else store.fetch(*args)
        out["ok"] = True
    except Exception as e:
        out.update(type=type(e).__name__, oserror=isinstance(e, OSError), errno=getattr(e, "errno", None), message=str(e),
                   cause_errno=getattr(e.__cause__, "errno", None))
print(json.dumps(out), flush=True)
"""


def _checkpoint(folder: Path, size: int) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden": 8}')
    (folder / "model.safetensors").write_bytes(os.urandom(size))
    return str(folder)


def _steps(work: Path, kind: str, shell: str, env: dict | None = None) -> list[dict]:
    script = work / "step.py"
    script.write_text(STEP)
    step = f"{sys.executable} {script}"
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = in_namespace(kind, shell.replace("STEP", step), env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return lines


def test_a_full_store_disk_names_the_store_the_path_the_setting_and_the_free_space(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    small, big = _checkpoint(tmp_path / "small", 4096), _checkpoint(tmp_path / "big", 1 << 20)
    root = f"{mnt}/store"
    published, full, state = _steps(tmp_path, "mounts", f"mount -t tmpfs -o size=256k tmpfs {mnt} && STEP publish {root} {small} {V1} "
                                                       f"&& STEP publish {root} {big} {V2} && STEP state {root} {V1} {V2}")
    assert published["ok"]
    assert (full["type"], full["errno"], full["cause_errno"], full["oserror"]) == ("StoreRefused", errno.ENOSPC, errno.ENOSPC, True)
    msg = full["message"]
    assert msg.startswith(f"artifact store {root}: upload to {root}/{V2} failed at {root}/{V2}/model.safetensors: "
                          "no space left on the device (ENOSPC; "), msg
    assert "free of 256.0 KiB on that filesystem" in msg and "run.store_uri" in msg
    # nothing already published is lost, and the failed publish took its partial files back
    assert (state["kept_verifies"], state["failed_exists"], state["left"]) == (True, False, [])


def test_a_read_only_store_filesystem_names_the_store_and_the_setting(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    small = _checkpoint(tmp_path / "small", 4096)
    root = f"{mnt}/store"
    published, refused, state = _steps(tmp_path, "mounts", f"mount -t tmpfs -o size=1m tmpfs {mnt} && STEP publish {root} {small} {V1} "
                                                           f"&& mount -o remount,ro {mnt} && STEP publish {root} {small} {V2} "
                                                           f"&& STEP state {root} {V1} {V2}")
    assert published["ok"]
    assert (refused["type"], refused["errno"], refused["cause_errno"]) == ("StoreRefused", errno.EROFS, errno.EROFS)
    assert refused["message"].startswith(f"artifact store {root}: ") and f"{root}/runs" in refused["message"]
    assert "the filesystem is read-only (EROFS); remount it read-write, or point the setting run.store_uri" in refused["message"]
    assert state["kept_verifies"] and not state["failed_exists"]


def test_a_store_folder_this_user_may_not_write_names_the_store_and_the_path(open_folder):
    root = str(open_folder / "store")
    ArtifactStore(root).publish(_checkpoint(open_folder / "small", 4096), V1, kind="checkpoint", producer="test")
    for dirpath, dirs, _ in os.walk(open_folder):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o555)  # readable, not writable, by everyone (the owner too)
    refused, state = _steps(open_folder, "unprivileged", f"STEP publish {root} {open_folder}/small {V2}; STEP state {root} {V1} {V2}",
                            env={"HOME": user_home(open_folder)})
    assert (refused["type"], refused["errno"]) == ("StoreRefused", errno.EACCES)
    assert refused["message"].startswith(f"artifact store {root}: ") and f"{root}/runs/r1/policy" in refused["message"]
    assert "permission denied (EACCES); give this user (uid " in refused["message"] and "run.store_uri" in refused["message"]
    assert state["kept_verifies"] and not state["failed_exists"]
    assert stat.S_IMODE(os.stat(f"{root}/{V1}").st_mode) == 0o555


def test_a_full_local_folder_a_fetch_writes_into_is_named_as_this_machines(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    store.publish(_checkpoint(tmp_path / "big", 1 << 20), V1, kind="checkpoint", producer="test")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (fetched,) = _steps(tmp_path, "mounts", f"mount -t tmpfs -o size=256k tmpfs {mnt} && STEP fetch {store.root} {V1} {mnt}/copy")
    assert (fetched["type"], fetched["errno"]) == ("StoreRefused", errno.ENOSPC)
    assert f"{mnt}/copy" in fetched["message"] and f"a folder on this machine outside the artifact store {store.root}" in fetched["message"]
    assert "free of 256.0 KiB" in fetched["message"] and "FLYROLL_CACHE_DIR" in fetched["message"]
    assert "run.store_uri" not in fetched["message"]
