"""The processes a test's own sandbox runs left alive.

As root, every sandbox run drops to a fresh random uid >= 2**30 (engines/sandbox/runner.py `_random_uid`).
Other processes run sandboxes at the same time (the other pytest-xdist worker, a pyflyte run scoring
code), so a leftover is a live process owned by a uid that one of *this* test's runs used: the
`no_leftovers` fixture records those uids by wrapping `_random_uid` (the sandbox itself runs as
is). Without root there is no uid drop: processes whose working directory is a sandbox work dir
(`flyroll-sbx-`) count then, which is exact only when no other process runs sandboxes meanwhile.
"""

from __future__ import annotations

import os

import pytest

from engines.sandbox import runner as sandbox


def sandbox_pids(uids: set[int]) -> set[int]:
    """Live, non-zombie processes owned by one of `uids` (or, without root, in a sandbox work dir)."""
    pids = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                st = f.read()
            if "State:\tZ" in st:
                continue
            uid = int(next(ln for ln in st.splitlines() if ln.startswith("Uid:")).split()[1])
            cwd = os.readlink(f"/proc/{d}/cwd") if os.geteuid() != 0 else ""
        except (OSError, StopIteration, ValueError):
            continue
        if uid in uids or "flyroll-sbx-" in cwd:
            pids.add(int(d))
    return pids


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch):
    """No sandbox process of this test may outlive its run_program call. Yields the uids used."""
    uids: set[int] = set()
    real = sandbox._random_uid

    def recording_random_uid() -> int:
        uid = real()
        uids.add(uid)
        return uid

    monkeypatch.setattr(sandbox, "_random_uid", recording_random_uid)
    before = sandbox_pids(uids) if os.geteuid() != 0 else set()
    yield uids
    leftover = sandbox_pids(uids) - before
    assert not leftover, f"sandbox processes survived: {leftover}"
