"""Running a command until a marker file appears, then killing its whole process tree
(tests/e2e/test_resume.py, tests/infra/test_tracking_run_status.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

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


def run_until_marker_then_kill(cmd: list[str], cwd: Path, env: dict[str, str], marker: Path, log_path: Path,
                               timeout_s: float = 480) -> str:
    """Start `cmd` in its own session, wait until `marker` exists (the run paused itself there), then
    SIGKILL its whole tree. Returns the run's output; fails the test, with the output's tail, when the
    run ended or `timeout_s` passed without the marker."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        known: dict[int, psutil.Process] = {}
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and proc.poll() is None and not marker.exists():
                known.update({p.pid: p for p in _descendants(proc.pid)})
                time.sleep(0.2)
        finally:
            _kill_tree(proc, known)
    out = log_path.read_text()
    assert marker.exists(), f"the run never reached {marker.name} (exit {proc.returncode}):\n{out[-3000:]}"
    return out
