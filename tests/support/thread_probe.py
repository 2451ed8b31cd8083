"""A Ray actor that reports the thread set-up it started with (tests/engines/models/test_threads.py)."""

from __future__ import annotations

import os

WATCHED = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


class ThreadProbe:
    def __init__(self, threads: int = 1):
        self.at_start = {k: os.environ.get(k) for k in WATCHED}  # before this process imports torch
        import torch

        from tasks.actors.process import engine_process

        engine_process(threads)
        self.torch_threads = torch.get_num_threads()

    def seen(self) -> dict:
        return {**self.at_start, "torch_threads": self.torch_threads}


def look_inside(_actor) -> dict:
    """Run inside any actor (`handle.__ray_call__.remote(look_inside)`, tests/tasks/actors/test_process_every_actor.py):
    the environment its process was started with (/proc/self/environ: before any import), its niceness,
    and torch's thread count (None when the process has not loaded torch)."""
    import sys

    with open("/proc/self/environ", "rb") as f:
        start = dict(v.split("=", 1) for v in f.read().decode(errors="replace").split("\0") if "=" in v)
    torch = sys.modules.get("torch")
    return {"start": start, "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "torch_threads": torch.get_num_threads() if torch is not None else None}
