"""A write the disk refused, in words: what is wrong (full, over quota, read-only, not permitted) and
how much room is left, for the errors of the artifact store (infra/store.py) and of a SQLite MLflow
store (infra/tracking_store.py). Nothing here writes or deletes anything."""

from __future__ import annotations

import errno
import os
import shutil

# errno -> (what is wrong, what to do about it there)
REFUSED = {
    errno.ENOSPC: ("no space left on the device", "free space there"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space within the quota or have it raised"),
    errno.EROFS: ("the filesystem is read-only", "remount it read-write"),
    errno.EACCES: ("permission denied", f"give this user (uid {os.getuid()}) access to it"),
    errno.EPERM: ("operation not permitted", f"give this user (uid {os.getuid()}) access to it"),
}


def refused_errno(e: BaseException) -> int | None:
    """The errno of `e` when it is a refused write (`REFUSED`), else None. s3fs raises a
    PermissionError without an errno for S3's AccessDenied: EACCES."""
    if isinstance(e, PermissionError) and e.errno is None:
        return errno.EACCES
    return e.errno if isinstance(e, OSError) and e.errno in REFUSED else None


def refused_path(e: OSError) -> str | None:
    """The path the refused call wrote: a copy names its source first and its destination second."""
    path = e.filename2 if e.filename2 is not None else e.filename
    return None if path is None else os.fsdecode(path)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_space(path: str) -> str:
    """`"<free> free of <total>"` on the filesystem of local `path` (or of its nearest existing
    folder), "" when it cannot be read."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return ""
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def cause(code: int, local_path: str | None) -> str:
    """What errno `code` (one of `REFUSED`) says is wrong, with its name, and for a full local disk how
    much room is left: "no space left on the device (ENOSPC; 0 B free of 256.0 KiB on that filesystem)"."""
    room = free_space(local_path) if local_path and code in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"{REFUSED[code][0]} ({errno.errorcode[code]}{f'; {room} on that filesystem' if room else ''})"
