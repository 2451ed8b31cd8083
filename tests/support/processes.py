"""Killing a run's whole process tree (tests/test_resume.py, tests/test_run_status.py)."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_tree(proc: subprocess.Popen, known: dict[int, psutil.Process]) -> None:
    """SIGKILL the run's process group, then any descendant seen while it ran that left the group
    (Ray starts some of its daemons in their own sessions)."""
    known.update({p.pid: p for p in _descendants(proc.pid)})
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the run already ended (the test then reports how)
        pass
    proc.wait(timeout=30)
    for p in known.values():
        try:
            p.kill()  # psutil checks the create time, so a recycled pid is never hit
        except psutil.NoSuchProcess:
            pass
