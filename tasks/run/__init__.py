"""A run's own records: typed task boundaries, store keys, config and store, checkpoints, replay, model import, data splits, seeds."""
