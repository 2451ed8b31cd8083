"""benchmarks/contention.py, smoke-sized (no measurement): each policy's environment, the torch competitor
beside a measurement and gone after it, a measured process past its time killed with what it printed."""

from __future__ import annotations

import os
import time

from benchmarks import contention


def test_each_policy_starts_from_a_clean_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("RAY_worker_niceness", "3")
    fair, before = contention.clean_env("fair"), contention.clean_env("passive")
    assert not set(contention.OMP_VARS) & set(fair)                   # the run as it comes: nothing of the caller's
    assert (before["RAY_worker_niceness"], before["OMP_NUM_THREADS"]) == ("15", "2")   # Ray's default, the preset's threads
    assert contention.clean_env("spin")["GOMP_SPINCOUNT"] == "300000" and contention.clean_env("fair-2t")["OMP_NUM_THREADS"] == "2"


def test_the_torch_competitor_runs_beside_the_measurement_and_ends_with_it(monkeypatch):
    made, seen, real = [], {}, contention.competitor
    monkeypatch.setattr(contention, "competitor", lambda **kw: made.append(real(**kw)) or made[-1])

    def measure():
        time.sleep(3)   # its torch import and first matmuls
        with open(f"/proc/{made[0].pid}/status") as f:
            seen["threads"] = int(next(x for x in f if x.startswith("Threads:")).split()[1])
        seen["running"] = made[0].poll() is None
        return 1.0

    assert contention.with_load({"kind": "torch", "threads": 2, "limit": 60}, measure) == 1.0
    assert seen == {"threads": seen["threads"], "running": True} and seen["threads"] >= 2   # torch's 2 OpenMP threads
    assert made[0].poll() is not None                                  # killed and reaped after the measurement


def test_a_measured_process_past_its_time_is_killed_with_what_it_printed():
    code = "import json, time\nprint(json.dumps({'iteration': 2, 'seconds': {}}), flush=True)\ntime.sleep(60)\n"
    t0 = time.monotonic()
    lines, done = contention._python(["-c", code], dict(os.environ), timeout=3)
    assert (lines, done) == ([{"iteration": 2, "seconds": {}}], False) and time.monotonic() - t0 < 30

