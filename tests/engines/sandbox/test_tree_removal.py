"""Removing what a sandboxed program leaves behind (engines/sandbox/tree_removal.py `remove_tree`, also
exported by engines/sandbox/runner.py): a work dir 100,000 levels deep with 200,000 files, odd names, links
out, a FIFO and a mode-000 dir is removed without recursion and without touching the links' targets,
on the host directly and after a real sandboxed run (slow tier)."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from engines.sandbox.runner import run_program
from tests.support.sandbox_procs import no_leftovers, sandbox_pids  # noqa: F401 -- autouse fixture


def _deep_tree_and_many_files(root: str, depth: int, files: int) -> None:
    """A `depth`-deep chain of dirs, `files` files, odd names, symlinks out, a FIFO, unreadable modes."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(files):
        os.close(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    for name in (b"-rf", b"new\nline", b"\xff\xfe", b" ", b"..."):
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.symlink("/etc", "etc-link", dir_fd=fd)
    os.symlink("/etc/hostname", "file-link", dir_fd=fd)
    os.mkfifo("fifo", dir_fd=fd)
    for i in range(depth):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.mkdir("locked", 0o000, dir_fd=fd)
    os.close(fd)


@pytest.mark.slow
def test_remove_tree_deep_many_odd(tmp_path):
    """The host-side removal of a work dir: 100,000 levels deep and 200,000 files, odd names, links
    out (their targets untouched), a FIFO (not opened), a mode-000 dir: all gone, no recursion."""
    from engines.sandbox.tree_removal import remove_tree
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):   # a tmpfs: the host disk's speed is not
        tmp_path = Path(__import__("tempfile").mkdtemp(prefix="flyroll-rt-", dir="/dev/shm"))  # what is tested
    victim = tmp_path / "outside"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    root = tmp_path / "work"
    root.mkdir()
    _deep_tree_and_many_files(str(root), 100_000, 200_000)
    os.symlink(str(victim), root / "victim-link")
    t0 = time.monotonic()
    files, _ = remove_tree(str(root))
    print(f"remove_tree: {files} entries in {time.monotonic() - t0:.1f} s")
    assert not root.exists() and files >= 300_000
    assert (victim / "keep").read_text() == "keep" and os.path.exists("/etc/hostname")
    remove_tree(str(victim))
    if str(tmp_path).startswith("/dev/shm/"):
        os.rmdir(tmp_path)


@pytest.mark.slow
def test_sandboxed_program_leaving_a_deep_tree_and_many_files(no_leftovers):
    """A program leaves 100,000 nested dirs, 200,000 files, links, a FIFO and a mode-000 dir in its
    work dir: the run gets a verdict and no trace of the work dir is left on the host."""
    code = textwrap.dedent(f"""
        import os
        {textwrap.indent(__import__("inspect").getsource(_deep_tree_and_many_files), "        ").strip()}
        _deep_tree_and_many_files(".", 100_000, 200_000)
        print("made")
    """)
    for kwargs in ({}, {"max_files": 400_000, "max_disk_mb": 1024}):
        before = set(os.listdir("/tmp"))
        v = run_program(code, timeout_s=60, **kwargs)
        assert v.verdict in (("disk",) if not kwargs else ("passed",)), v
        assert not {p for p in set(os.listdir("/tmp")) - before if p.startswith("flyroll-sbx-")}
