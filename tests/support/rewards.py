"""User reward functions that test configs name by path (`reward.functions`, `metadata.reward_fn`):
`tests.support.rewards:parity` (tests/engines/generation/test_scheduler.py, tests/tasks/loop/test_prompts_refill.py, tests/tasks/loop/test_partial_rollout.py),
`tests.support.rewards:graded` (tests/engines/rewards/test_evaluation_routing.py, tests/infra/test_eval_cli.py),
`tests.support.rewards:pausing_starts_with_digit` (tests/e2e/test_resume.py, tests/tasks/loop/test_publish_plan.py)."""

from __future__ import annotations

import glob
import os
import time


def parity(response: str, sample: dict) -> float:
    """A real reward with variance across a random policy's samples; prompt "boom" raises, "hang" hangs."""
    if sample["prompt"] == "boom":
        raise ValueError("broken reward")
    if sample["prompt"] == "hang":
        time.sleep(3.0)
    return float(sum(map(ord, response)) % 2)


def graded(response: str, sample: dict) -> float:
    """A user reward with partial credit: 1.0 when the response starts with a digit, else 0.5."""
    return 1.0 if response[:1].isdigit() else 0.5


def pausing_starts_with_digit(response: str, sample: dict) -> float:
    """The e2e reward; the first call after a file matching the glob $FLYROLL_TEST_PAUSE_AFTER exists
    creates $FLYROLL_TEST_PAUSED and sleeps (the test kills the run meanwhile)."""
    after, marker = os.environ.get("FLYROLL_TEST_PAUSE_AFTER"), os.environ.get("FLYROLL_TEST_PAUSED")
    if after and marker and glob.glob(after, recursive=True):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            time.sleep(45)
        except FileExistsError:
            pass
    return float(response[:1].isdigit())
