"""Helpers shared by several test files (a `test_*.py` never imports from another `test_*.py`;
tests/test_architecture.py checks it): import them as `from tests.support.<module> import ...`.

- `workflow`: the `pyflyte run` of workflows/rlvr.py in a temp folder (REPO, PYFLYTE, `_env`, `_config`,
  `_pyflyte_run`, `_mlflow`);
- `agentic`: the same for workflows/agentic.py (`_run`, `_history`);
- `engines`: the tiny policy's prompts and tensors (PROMPTS, `encode`, `params_of`, `rl_batch`);
- `training`: a scored rollout table the training path reads (`_scored_table`);
- `rollout`: the real rollout task on the tiny model (`_parity_rollout_run`) and a Ray generation
  actor's abort (`abort_then_serve`);
- `rewards`: user reward functions that configs name by path (`tests.support.rewards:parity`, `:graded`);
- `processes`: SIGKILL a run's whole process tree (`_descendants`, `_kill_tree`);
- `folders`, `thread_probe`: a read-only folder for store refusals; a thread-policy probe.
"""
