"""The parts of a weight sync that need no update group (engines/weight_sync/update_group.py, which exports every
name here too): what a receiving engine offers (`WeightReceiver`), what a sync reports (`SyncReport`),
the trainer-side gathers of sharded parameters, one parameter at a time (`gathered`, `gather_only`: an
FSDP2 DTensor's `full_tensor()`, a ZeRO-3 parameter's `GatheredParameters`; never the whole model), and
a hybrid worker's in-process sync (`copy_in_process`: the trainer's tensors copied straight into the
engine's weights in the same process, tasks/actors/hybrid.py)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class WeightReceiver(Protocol):
    """What an engine offers to a sync (HFGenerationEngine, VLLMGenerationEngine)."""
    version: int | None

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], bool]]: ...  # name -> (shape, required)
    def weight_dtype(self) -> torch.dtype: ...                           # dtype its weights are held in
    def update_weights(self, named_tensors, source: str = ..., partial: bool = False) -> None: ...
    def finish_weight_update(self, version: int) -> None: ...            # all buckets applied: serve `version`


@dataclass(frozen=True)
class SyncReport:
    version: int
    transport: str
    dtype: str
    buckets: int
    tensors: int
    bytes: int                      # payload bytes sent (wire dtype)
    seconds: float
    gathered_peak_bytes: int = 0    # the largest full tensor a gather materialised (0: nothing was partitioned)


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape: a DTensor's global shape, a ZeRO-3 parameter's `ds_shape`."""
    return tuple(getattr(t, "ds_shape", None) or t.shape)


@contextlib.contextmanager
def gathered(t: torch.Tensor):
    """The full tensor of one parameter, gathered on every training rank (a collective of the trainer's
    own group: every training rank must enter it in the same order, `gather_only` on ranks > 0)."""
    if hasattr(t, "full_tensor"):              # FSDP2 / DTensor
        yield t.full_tensor().detach()
    elif hasattr(t, "ds_id"):                  # DeepSpeed ZeRO-3
        import deepspeed

        with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
            yield t.detach()
    else:
        yield t.detach()


def is_shard(t: torch.Tensor) -> bool:
    """Whether `t` is one rank's shard of a parameter (FSDP2 DTensor, ZeRO-3) that `gathered` gathers."""
    return hasattr(t, "full_tensor") or hasattr(t, "ds_id")


def is_partial(t: torch.Tensor) -> bool:
    """Whether gathering `t` materialises a full tensor this rank did not hold: every FSDP2 DTensor; a
    ZeRO-3 parameter only while partitioned (DeepSpeed keeps one under `stage3_param_persistence_threshold`
    elements whole on every rank, and leaves an empty placeholder in place of a partitioned one)."""
    return hasattr(t, "full_tensor") or (hasattr(t, "ds_id") and t.numel() == 0)


def gather_only(named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Training ranks > 0 of a sharded trainer: take part in rank 0's per-parameter gathers of a sync
    (every parameter, in order; rank 0's `send` completes the same gathers even when the sync fails)."""
    for _, t in named_params:
        if is_shard(t):
            with gathered(t):
                pass


def copy_in_process(named_params: Iterable[tuple[str, torch.Tensor]], engine: WeightReceiver, version: int) -> SyncReport:
    """A hybrid worker's sync (a trainer and its generation engine in one process, tasks/actors/hybrid.py): the
    trainer's tensors copied straight into the engine's weights, cast to the engine's dtype, no group,
    no wire buffer. Plain tensors: one full update, every name and shape checked before the first copy
    (a refused update leaves the engine as it was). Shards (FSDP2, ZeRO-3): gathered one parameter at a
    time, as `send` gathers them; every training rank calls this at once, in the same parameter order
    (each gather is a collective of the trainer's group), and each fills its own engine: a partial
    update (the engine refuses to generate until `finish_weight_update`), checked against the engine's
    spec first. Returns the report; raises ValueError naming what did not match."""
    params, start = list(named_params), time.perf_counter()
    nbytes = sum(numel(full_shape(t)) for _, t in params) * engine.weight_dtype().itemsize
    if not any(is_shard(t) for _, t in params):
        engine.update_weights(params, source=f"the trainer's weights of policy v{version}", version=version)
        return SyncReport(version, "in_process", str(engine.weight_dtype()).removeprefix("torch."), 0, len(params), nbytes,
                          time.perf_counter() - start, 0)
    spec = engine.weight_spec()
    wrong = [f"{n} {full_shape(t)} != {spec[n][0] if n in spec else 'not in the engine'}"
             for n, t in params if n not in spec or tuple(spec[n][0]) != full_shape(t)]
    given = {n for n, _ in params}
    missing = [n for n, (_, required) in spec.items() if required and n not in given]
    if wrong or missing:
        gather_only(params)  # the other ranks make these gathers too: leave none of them waiting
        raise ValueError(f"the trainer's weights of policy v{version} do not match the engine's model: "
                         f"missing={missing[:5]} unexpected={wrong[:5]}")
    peak = 0
    for name, t in params:
        partial = is_partial(t)
        with gathered(t) as full:
            if partial:
                peak = max(peak, full.numel() * full.element_size())
            engine.update_weights([(name, full)], source=f"the trainer's weights of policy v{version}", partial=True)
    engine.finish_weight_update(version)
    return SyncReport(version, "in_process", str(engine.weight_dtype()).removeprefix("torch."), 0, len(params), nbytes,
                      time.perf_counter() - start, peak)
