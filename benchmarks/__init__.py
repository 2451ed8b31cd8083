"""Benchmarks. Importing the package sets the passive OpenMP wait policy first, before anything loads
torch (engines/threads.py); the scripts it starts inherit it."""

from engines.threads import set_wait_policy

set_wait_policy()
