"""A training engine's state off its device between steps (`placement.offload_train`, docs/placement.md).

A colocated trainer holds its float32 weights, AdamW's two moments and the last step's gradients
(four times the weight bytes; ~2.2 GB for SmolLM2-135M) through the rollout that follows, so the
colocated peak stays train + generate. As verl and ROLL do, `TrainStateOffload` moves that state
away after the step and the live sync that reads the weights, and back before the next use:

- `optimizer`: AdamW's state tensors (moments and step counts) and the gradients (set to None:
  every update zeroes them with `set_to_none` before its first backward, so nothing is lost);
- `params`: the parameters too (tied ones are one parameter, moved once).

Where they go: from a CUDA device to host memory (pinned when it can be); from the CPU to an unnamed
temporary file in `folder` (torch.save; `tempfile.TemporaryFile`, O_TMPFILE on Linux), since on a CPU
host only leaving the process's memory lowers its RSS. The file has no name, so the kernel frees it when
the actor ends however it ends: a killed or OOM-killed actor leaves no gigabytes behind in the temp dir.
The device side keeps empty tensors of the recorded dtype, so an update run while offloaded fails
on a shape error instead of silently starting AdamW afresh. `reload` puts the very tensors back
(torch.save / load round-trips bitwise); the engine then steps exactly as if nothing had moved
(tests/engines/training/test_offload.py). Only a one-process engine (strategy `torch`) is handled: sharded
(DTensor, DeepSpeed) state is refused by the config (configs/hand_off.py).
"""

from __future__ import annotations

import os
import tempfile

import torch

PARTS = {"none": (), "optimizer": ("optimizer",), "all": ("optimizer", "params")}  # placement.offload_train -> parts


class EngineOffload:
    """What a training actor holds for `placement.offload_train`: its `TrainStateOffload`, made on first
    use (writing to the temp dir), and the three calls the actor makes of it."""

    def __init__(self):
        self.state: TrainStateOffload | None = None

    def release(self, engines: dict, mode: str, keep_params: bool = False) -> int:
        """Move `PARTS[mode]` of `engines` ({name: engine or None}) away, the parameters not while
        `keep_params` (a live sync still reads them). Returns the bytes moved."""
        parts = tuple(p for p in PARTS[mode] if not (keep_params and p == "params"))
        if not parts:
            return 0
        if self.state is None:
            self.state = TrainStateOffload({k: e for k, e in engines.items() if e is not None}, tempfile.gettempdir())
        return self.state.offload(parts)

    def reload(self) -> None:
        """What is away back on the device, before anything reads it."""
        if self.state is not None:
            self.state.reload()

    def discard(self) -> None:
        """Forget what is away: the engines it belongs to were replaced."""
        if self.state is not None:
            self.state.discard()
            self.state = None


def _params(engine) -> list[torch.nn.Parameter]:
    return list(engine.module.parameters())  # unique: a tied embedding is one parameter


class TrainStateOffload:
    """Offloads and reloads the state of `engines` ({name: a `_PPOEngine`: the actor's, the critic's})."""

    def __init__(self, engines: dict, folder: str):
        self.engines, self.folder = engines, folder
        self.away: dict[tuple[str, str], object] = {}   # (engine, part) -> an open unnamed file, or host tensors (CUDA)

    @property
    def offloaded(self) -> set[str]:
        return {part for _, part in self.away}

    def offload(self, parts: tuple[str, ...]) -> int:
        """Move `parts` ("optimizer", "params") of every engine off the device (those already away stay
        away); returns the bytes moved. Call `engines.models.host_memory.release_allocator_caches` after it
        so the process hands the freed memory back."""
        moved = 0
        for name, engine in self.engines.items():
            for part in parts:
                if part not in ("optimizer", "params"):
                    raise ValueError(f"offload part {part!r}: expected 'optimizer' or 'params'")
                if (name, part) in self.away:
                    continue
                if part == "optimizer":
                    for p in _params(engine):
                        p.grad = None
                tensors = self._tensors(engine, part)
                moved += sum(t.numel() * t.element_size() for t in tensors.values())
                self.away[(name, part)] = self._store(name, part, tensors)
                empty = {k: torch.empty(0, dtype=t.dtype, device=t.device) for k, t in tensors.items()}
                self._assign(engine, part, empty)
        return moved

    def reload(self) -> None:
        """Put every offloaded part back, bitwise as it left."""
        for (name, part), where in list(self.away.items()):
            engine = self.engines[name]
            if isinstance(where, dict):
                tensors = where
            else:
                where.seek(0)
                tensors = torch.load(where, weights_only=True, map_location="cpu")
                where.close()
            device = {k: t.device for k, t in self._tensors(engine, part).items()}  # the empty placeholders'
            self._assign(engine, part, {k: t.to(device[k], non_blocking=True) for k, t in tensors.items()})
            del self.away[(name, part)]
        if any(t.device.type == "cuda" for e in self.engines.values() for t in _params(e)):
            torch.cuda.synchronize()

    def discard(self) -> None:
        """Forget what is away (the engines were replaced): its files are closed, which frees them."""
        for where in self.away.values():
            if not isinstance(where, dict):
                where.close()
        self.away.clear()

    @staticmethod
    def _tensors(engine, part: str) -> dict[str, torch.Tensor]:
        if part == "params":
            return {str(i): p.data for i, p in enumerate(_params(engine))}
        index = {id(p): i for i, p in enumerate(_params(engine))}
        return {f"{index[id(p)]}.{k}": v for p, s in engine.optimizer.state.items() for k, v in s.items()
                if isinstance(v, torch.Tensor)}

    @staticmethod
    def _assign(engine, part: str, tensors: dict[str, torch.Tensor]) -> None:
        params = _params(engine)
        if part == "params":
            for k, t in tensors.items():
                params[int(k)].data = t
            return
        for key, t in tensors.items():
            i, k = key.split(".", 1)
            engine.optimizer.state[params[int(i)]][k] = t

    def _store(self, name: str, part: str, tensors: dict[str, torch.Tensor]):
        if any(t.device.type == "cuda" for t in tensors.values()):
            pin = torch.cuda.is_available()
            return {k: t.to("cpu").pin_memory() if pin else t.to("cpu") for k, t in tensors.items()}
        os.makedirs(self.folder, exist_ok=True)
        f = tempfile.TemporaryFile(prefix=f"flyroll-offload-{name}-{part}-", dir=self.folder)
        try:
            torch.save(tensors, f)
            f.flush()
        except BaseException:
            f.close()  # a full disk: nothing is left half-written
            raise
        return f
