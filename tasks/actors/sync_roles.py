"""What an engine actor holds for live weight sync (tasks/loop/live_sync.py), as collaborators rather
than methods it grows: its place in a model update group (`GroupMember`: the trainer's rank 0 sends,
every generation actor receives) and, on a trainer, the weights its last step kept for the sync that
follows it (`KeptWeights`). The actors' Ray methods delegate to these."""

from __future__ import annotations

import ray

# The engines are imported inside the methods, as the actors do (tasks/actors/generation.py): a driver
# importing this module loads no torch.


class GroupMember:
    """One actor's membership in a model update group (engines/weight_sync/update_group.py `ModelUpdateGroup`)."""

    def __init__(self):
        self.group = None         # the ModelUpdateGroup, once joined
        self.token = None         # the group's token, as the live sync set-up named it

    def join(self, address: str, port: int, world_size: int, rank: int, token: str, timeout_s: float,
             transport: str, member: str) -> str:
        """Join group `token` as `rank` (0 sends), leaving the group held before; returns the token.
        `member`: how the group names this actor in its errors."""
        from engines.weight_sync.update_group import ModelUpdateGroup

        if self.group is not None:
            self.group.close()
        self.group = None
        self.group = ModelUpdateGroup(address, port, world_size, rank, transport=transport, timeout_s=timeout_s,
                                      member=member)
        self.token = token
        return token

    def state(self, ready: bool = True) -> dict:
        """{"token": the usable group this actor is in (None: none, broken by a failed sync, or not `ready`),
        "transport": its transport, "node": this actor's Ray node id}."""
        usable = self.group is not None and not self.group.broken and ready
        return {"token": self.token if usable else None, "transport": self.group.transport if usable else None,
                "node": ray.get_runtime_context().get_node_id()}


class KeptWeights:
    """The weights a trainer's step kept for the live sync after it (`TrainWorker.step(keep_weights=True)`),
    taken once by the sync: rank 0's (or every rank's, in a hybrid worker where each rank fills an engine
    of its own: `every_rank`), or none, when a sharded trainer gathers per bucket instead."""

    def __init__(self):
        self.kept = False          # whether the last step kept weights for a sync
        self.weights = None        # {name: tensor} kept on this rank, or None
        self.every_rank = False    # a hybrid worker's trainer (tasks/actors/hybrid.py)

    def keep(self, kept: bool, weights: dict | None, rank: int) -> None:
        self.kept = kept
        self.weights = weights if rank == 0 or self.every_rank else None

    def take(self, model) -> tuple[bool, dict | None, list, bool]:
        """(whether the step kept weights, the weights this rank kept or None, `model`'s plain named
        parameters, whether they are shards); what was kept is handed over once."""
        from engines.training.lora import plain_model
        from engines.weight_sync.gather import is_shard

        kept, self.kept = self.kept, False
        weights, self.weights = self.weights, None
        params = list(plain_model(model).named_parameters())
        return kept, weights, params, any(is_shard(p) for _, p in params)
