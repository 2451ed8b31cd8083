"""Reward functions that misbehave, routed to by tests/tasks/stages/test_scoring.py through `reward.functions`."""

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
