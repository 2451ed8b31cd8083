"""Flyte workflows. Importing the package sets the passive OpenMP wait policy first, before anything
loads torch (engines/threads.py): `pyflyte run workflows/rlvr.py` imports this file before rlvr.py."""

from engines.threads import set_wait_policy

set_wait_policy()
