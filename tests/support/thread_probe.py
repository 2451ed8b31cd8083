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
