"""Flyte tasks. Importing the package sets the passive OpenMP wait policy first, before anything loads
torch (engines/models/threads.py): a task pod on a Flyte cluster imports its task's module, not workflows/."""

from engines.models.threads import set_wait_policy

set_wait_policy()
