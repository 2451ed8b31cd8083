"""infra/ray_session.py: the CPU priority a local Ray gives its workers and each actor is told to take."""

from __future__ import annotations

import os

from engines.models.threads import NICE_ENV
from infra import ray_session


def test_a_local_ray_starts_its_workers_at_this_process_priority_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv(ray_session.WORKER_NICENESS, raising=False)
    ray_session.equal_worker_priority()
    assert os.environ[ray_session.WORKER_NICENESS] == "0"          # Ray's own default is 15
    assert ray_session.actor_priority_env() == {NICE_ENV: str(os.getpriority(os.PRIO_PROCESS, 0))}
    monkeypatch.setenv(ray_session.WORKER_NICENESS, "15")
    ray_session.equal_worker_priority()
    assert os.environ[ray_session.WORKER_NICENESS] == "15"         # the user's, kept
    assert ray_session.actor_priority_env() == {}                   # and the actors stay below this process, as asked
