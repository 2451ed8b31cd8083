"""Reward functions that misbehave, routed to by tests/tasks/stages/test_scoring.py through `reward.functions` and
run by tests/engines/rewards/test_calls.py."""

import os
import time


def ok(response: str, sample: dict) -> float:
    return 1.0


def boom(response: str, sample: dict) -> float:
    raise ValueError(f"cannot parse {response!r}")


def hang(response: str, sample: dict) -> float:
    time.sleep(60)
    return 1.0


def crash(response: str, sample: dict) -> float:
    os._exit(3)  # takes the whole reward worker process down


def infinite(response: str, sample: dict) -> float:
    return float("inf")


def huge(response: str, sample: dict) -> float:
    return 1e30


def text(response: str, sample: dict) -> float:
    return "1.0"  # a string that float() would accept: still not a reward


def nothing(response: str, sample: dict) -> float:
    return None


def spin(response: str, sample: dict) -> float:
    while True:  # a busy hang: no sleep to interrupt
        pass


def spin_and_tell(response: str, sample: dict) -> float:
    """Writes its process id to sample["pid_file"], then spins."""
    with open(sample["pid_file"], "w") as f:
        f.write(str(os.getpid()))
    spin(response, sample)
