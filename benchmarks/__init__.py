"""Benchmarks. Importing the package sets the passive OpenMP wait policy first, before anything loads
torch (engines/models/threads.py); the scripts it starts inherit it."""

from engines.models.threads import set_wait_policy

set_wait_policy()
