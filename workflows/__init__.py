"""Flyte workflows. Importing the package sets the passive OpenMP wait policy first, before anything
loads torch (engines/models/threads.py): `pyflyte run workflows/rlvr.py` imports this file before rlvr.py.

It also refuses `--set` given more than once on the command line: pyflyte turns the workflows' `set`
input (a list) into one option that takes a JSON list, and click keeps only the last of a repeated
option, so `--set '["a=1"]' --set '["b=2"]'` would drop a=1 without a word."""

import sys
import warnings

from engines.models.threads import set_wait_policy

set_wait_policy()


def _refuse_repeated_set(argv: list[str]) -> None:
    given = [a for a in argv if a == "--set" or a.startswith("--set=")]
    if len(given) > 1:
        raise SystemExit("flyroll: --set is given more than once; pyflyte would keep only the last. Give every "
                         "override in one JSON list: --set '[\"rollout.temperature=0.7\", \"training.lr=1e-5\"]'")


_refuse_repeated_set(sys.argv)

# flytekit registers a bool input as both `--restart` and `--restart/--no_restart`; click then warns (every workflow)
warnings.filterwarnings("ignore", message="The parameter --restart is used more than once")
