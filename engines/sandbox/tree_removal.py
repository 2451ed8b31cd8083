"""`remove_tree`: remove a directory tree that hostile code wrote (a sandbox's host work dir,
engines/sandbox/runner.py), counting what it held, without recursion, without following a link and without
being redirected by a directory moved meanwhile. engines/sandbox/runner.py exports it too."""

from __future__ import annotations

import os
import stat as S


def remove_tree(path: str) -> tuple[int, int]:
    """Remove `path` and everything under it; returns (entries removed, bytes they held).

    Iterative and fd-based: one directory fd open at a time (any depth: no recursion, no PATH_MAX,
    no fd limit), names taken relative to that fd (any bytes, newlines, leading dashes), never
    following a symlink (a link is unlinked, its target untouched), FIFOs / sockets / devices
    unlinked without being opened, directories without read or search permission chmod-ed 0700
    first. Going back up re-opens ".." and checks it is the directory it came from (device and
    inode), so a directory moved meanwhile stops the removal instead of redirecting it. Errors
    other than "already gone" propagate."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, 0
    if not S.S_ISDIR(st.st_mode):
        os.unlink(path)
        return 1, st.st_blocks * 512
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def open_dir(name: str | bytes, parent: int | None) -> int:
        try:
            return os.open(name, flags, dir_fd=parent)
        except PermissionError:
            os.chmod(name, 0o700, dir_fd=parent) if parent is not None else os.chmod(name, 0o700)
            return os.open(name, flags, dir_fd=parent)

    files = nbytes = 0
    fd = open_dir(path, None)
    # one level per entry: (name in its parent, (st_dev, st_ino) of the parent, subdirectories left)
    stack: list[tuple[bytes | None, tuple[int, int] | None, list[bytes]]] = []
    name: bytes | None = None
    parent_id: tuple[int, int] | None = None
    try:
        while True:
            subdirs: list[bytes] = []
            with os.scandir(fd) as it:
                for e in it:
                    n = os.fsencode(e.name)
                    est = os.stat(n, dir_fd=fd, follow_symlinks=False)
                    if S.S_ISDIR(est.st_mode):
                        subdirs.append(n)
                    else:
                        os.unlink(n, dir_fd=fd)
                        files += 1
                        nbytes += est.st_blocks * 512
            me = os.fstat(fd)
            stack.append((name, parent_id, subdirs))
            while stack and not stack[-1][2]:          # done with this level: go up, remove it
                name, parent_id, _ = stack.pop()
                if not stack:
                    break
                up = os.open("..", flags, dir_fd=fd)
                ust = os.fstat(up)
                if (ust.st_dev, ust.st_ino) != parent_id:
                    os.close(up)
                    raise RuntimeError(f"remove_tree: {path}: a directory was moved during the removal; stopped")
                os.close(fd)
                fd = up
                os.rmdir(name, dir_fd=fd)
                files += 1
                me = ust
            if not stack:
                break
            name = stack[-1][2].pop()
            parent_id = (me.st_dev, me.st_ino)
            child = open_dir(name, fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    os.rmdir(path)
    return files, nbytes
