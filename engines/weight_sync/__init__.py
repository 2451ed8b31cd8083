"""Live weight sync from the trainer to the generation engines: the update group and the gathers it needs."""
