"""engines/rewards/calls.py: reward calls in worker processes that a hang, a crash or a non-number cannot
take past their limits (issue 60): a hanging call is killed at its timeout, the batch ends within its
budget, and only finite numbers in bounds are scores."""

from __future__ import annotations

import os
import time

import pytest

from engines.rewards.calls import Call, Limits, RewardCalls, call_time_left, check_value
from engines.rewards.exact_match import exact_match_reward
from tests.support import hostile_rewards as hostile


@pytest.fixture(scope="module")
def calls():
    with RewardCalls(2) as c:
        yield c


def _call(fn, response="x", sample=None, name=None):
    return Call(name or getattr(fn, "__name__", "fn"), fn, response, sample or {})


def test_values_and_errors_come_back_in_order(calls):
    out = calls.run([_call(exact_match_reward, "7", {"answer": "7"}), _call(hostile.boom, "r"),
                     _call(lambda r, s: 0.25), _call(exact_match_reward, "8", {"answer": "7"})])
    assert [o.reward for o in out] == [1.0, 0.0, 0.25, 0.0]
    assert [o.error is None for o in out] == [True, False, True, True]
    assert out[1].error.startswith("ValueError: cannot parse 'r'")


@pytest.mark.parametrize("fn, says", [(hostile.infinite, "reward is inf"), (hostile.huge, "outside"),
                                      (hostile.text, "reward is str"), (hostile.nothing, "reward is NoneType"),
                                      (lambda r, s: float("nan"), "reward is nan")])
def test_a_reward_that_is_not_a_finite_number_in_bounds_is_an_error(calls, fn, says):
    (res,) = calls.run([_call(fn)])
    assert res.reward == 0.0 and says in res.error


def test_bounds_are_inclusive_and_configurable():
    assert check_value(True) == 1.0 and check_value(3) == 3.0 and check_value(-1e6) == -1e6
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        check_value(1.5, (0.0, 1.0))
    import numpy as np

    assert check_value(np.float32(0.5)) == 0.5
    with pytest.raises(TypeError):
        check_value(np.array([0.5]))


def test_hanging_calls_are_killed_at_their_timeout_and_do_not_hold_the_pool(calls):
    """Four calls that hang (one sleeping, three spinning) and four good ones on a 2-process pool: each hang
    costs its timeout once, in parallel, and the good calls still score -- not 4 x 60 s of stuck threads."""
    batch = [_call(hostile.hang), _call(hostile.spin), _call(hostile.spin), _call(hostile.spin)]
    batch += [_call(exact_match_reward, "1", {"answer": "1"}) for _ in range(4)]
    t0 = time.monotonic()
    out = calls.run(batch, Limits(timeout_s=0.5))
    wall = time.monotonic() - t0
    assert wall < 6, wall   # 4 timeouts of 0.5 s over 2 processes, plus restarts (1.2 s here)
    for res, name in zip(out[:4], ["hang", "spin", "spin", "spin"]):
        assert res.reward == 0.0 and "timeout after 0.5s" in res.error and repr(name) in res.error
    assert [o.reward for o in out[4:]] == [1.0] * 4
    (after,) = calls.run([_call(exact_match_reward, "1", {"answer": "1"})])   # the pool recovered
    assert after.reward == 1.0


def test_the_batch_budget_bounds_scoring_wall_time(calls):
    """Ten hanging calls with a 5 s timeout each would take 25 s on 2 processes; the 1.5 s budget ends them all."""
    t0 = time.monotonic()
    out = calls.run([_call(hostile.hang) for _ in range(10)], Limits(timeout_s=5.0, budget_s=1.5))
    wall = time.monotonic() - t0
    assert wall < 1.5 + 2.0, wall   # the budget, plus killing the two running processes
    assert all(o.reward == 0.0 and "reward.budget_s" in o.error and "'hang'" in o.error for o in out)


def test_a_call_that_kills_its_process_costs_only_its_sample(calls):
    out = calls.run([_call(hostile.crash), _call(exact_match_reward, "2", {"answer": "2"})])
    assert "killed its worker process (exit code 3)" in out[0].error and "'crash'" in out[0].error
    assert out[1].reward == 1.0 and out[1].error is None


def test_a_function_that_cannot_be_sent_is_named(calls):
    import threading

    lock = threading.Lock()
    (res,) = calls.run([_call(lambda r, s: lock.locked() * 1.0, name="locky")])
    assert "'locky' cannot be sent to a worker process" in res.error


def _time_left(response, sample):
    return call_time_left()


def test_a_call_knows_its_time_left(calls):
    assert call_time_left() is None   # not inside a call
    (res,) = calls.run([_call(_time_left)], Limits(timeout_s=4.0))
    assert 3.0 < res.reward <= 4.0


def test_a_killed_caller_leaves_no_worker_behind(tmp_path):
    """Workers die with their fork server, which ends with the pool's process: a spinning call does not
    outlive a caller killed by SIGKILL (as a replaced Ray actor is)."""
    import signal
    import subprocess
    import sys

    import psutil

    pid_file = tmp_path / "worker.pid"
    script = (
        "import sys, time\n"
        "from engines.rewards.calls import Call, Limits, RewardCalls\n"
        "from tests.support.hostile_rewards import spin_and_tell\n"
        f"RewardCalls(1).run([Call('spin_and_tell', spin_and_tell, '', {{'pid_file': {str(pid_file)!r}}})], Limits(timeout_s=600))\n")
    caller = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and caller.poll() is None, "the call never started"
            time.sleep(0.1)
        worker = psutil.Process(int(pid_file.read_text()))
        assert worker.is_running()
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        gone, alive = psutil.wait_procs([worker], timeout=10)
        assert not alive, f"worker {worker.pid} outlived its killed caller"
    finally:
        caller.kill()


def test_calls_run_under_a_deep_tmpdir(tmp_path):
    """The fork server's socket lives in multiprocessing's temp dir; under a TMPDIR too deep for a unix
    socket path (a Ray actor in a test's or a job's scratch folder) the calls still run."""
    import subprocess
    import sys

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    script = ("from engines.rewards.calls import Call, RewardCalls\n"
              "from engines.rewards.exact_match import exact_match_reward\n"
              "(res,) = RewardCalls(1).run([Call('exact', exact_match_reward, '4', {'answer': '4'})])\n"
              "print(res.reward, res.error)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), env={**os.environ, "TMPDIR": str(deep)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["1.0", "None"], proc.stderr[-2000:]


def test_a_function_over_the_error_rate_is_not_run_further(calls):
    """Twenty calls of a function that always hangs, with reward.max_error_rate 0.5: once 11 of its 20 have failed the
    rest are not started (the batch is over the limit for it), so it costs ~6 rounds of timeouts instead of 10."""
    out = calls.run([_call(hostile.hang) for _ in range(20)] + [_call(exact_match_reward, "1", {"answer": "1"})],
                    Limits(timeout_s=0.3, max_error_rate=0.5))
    timeouts = [o for o in out[:20] if "timeout after 0.3s" in o.error]
    skipped = [o for o in out[:20] if "not run, it already failed on 11 of 20" in o.error]
    assert 11 <= len(timeouts) <= 12 and len(timeouts) + len(skipped) == 20   # 12: the two processes finish together
    assert "over reward.max_error_rate" in skipped[0].error and out[20].reward == 1.0
    out = calls.run([_call(hostile.boom) for _ in range(4)], Limits(max_error_rate=1.0))   # 1: every call runs
    assert all(o.error.startswith("ValueError") for o in out)
