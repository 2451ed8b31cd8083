"""Folders tests need: one this process cannot write into, and real refusals from the kernel -- a full
disk, a read-only filesystem, a folder this user may not write -- in a namespace of a child process,
even where the tests run as root (tests/infra/test_store_refused_writes.py, tests/infra/test_tracking_store.py)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


def read_only_folder(tmp_path) -> str:
    """A folder this process cannot write into (as root a chmod does not stop writes: use /sys)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if not os.access(ro, os.W_OK):
        return str(ro / "store")
    try:
        open("/sys/.flyroll-probe", "w").close()
    except OSError:
        return "/sys/flyroll-store"
    os.remove("/sys/.flyroll-probe")
    pytest.skip("no read-only folder available")


# `unshare` flags: -rm a user and a mount namespace in which the child is root and may mount a tmpfs
# or remount a folder read-only (nothing outside it sees the mounts); -U a user namespace in which the
# child is an unprivileged user, so file modes hold for it even when the tests run as root
NAMESPACES = {"mounts": ["-rm", "--propagation", "private"], "unprivileged": ["-U"]}


@functools.cache
def _unshare_works(kind: str) -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", *NAMESPACES[kind], "true"], capture_output=True).returncode == 0


def in_namespace(kind: str, shell: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `shell` (sh -c) in a child process in namespace `kind` of `NAMESPACES`; the test is skipped
    where this kernel or container does not allow it (unprivileged user namespaces turned off)."""
    if not _unshare_works(kind):
        pytest.skip(f"unshare {' '.join(NAMESPACES[kind])} is not permitted here")
    return subprocess.run(["unshare", *NAMESPACES[kind], "sh", "-c", shell], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def open_folder():
    """A folder under /tmp every user may enter, for a child in the `unprivileged` namespace (pytest's
    tmp_path is private to its user); removed afterwards, whatever modes the test left in it."""
    folder = Path(tempfile.mkdtemp(prefix="flyroll-open-"))
    folder.chmod(0o755)
    yield folder
    for dirpath, dirs, _ in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o755)
    shutil.rmtree(folder)


def user_home(folder: Path) -> str:
    """A HOME under `folder` that any user may write (the `unprivileged` child's user owns nothing)."""
    home = folder / "home"
    home.mkdir(exist_ok=True)
    home.chmod(0o777)
    return str(home)
