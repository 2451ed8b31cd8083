"""Unit tests of engines/models/host_memory.py: engine processes serve large tensors from the heap, on a tiny char-level Qwen2 built in the test
(seconds on one CPU thread)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


_MMAPPED_BYTES = """
import ctypes, sys, torch
from engines.models.host_memory import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
x = torch.ones(64 * 2**20 // 4)           # a 64 MiB tensor: above glibc's largest mmap threshold
print(kept, libc.mallinfo2().hblkhd)      # bytes held in mmap'd blocks
"""


@pytest.mark.parametrize("mode", ["keep", "default"])
def test_engine_processes_serve_large_tensors_from_the_heap(mode):
    """With keep_freed_memory() a 64 MiB tensor comes from the heap (reused after free), not a
    fresh mmap (unmapped on free and faulted in again next time) as with glibc's defaults."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _MMAPPED_BYTES, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    kept, mmapped = r.stdout.split()[-2:]
    if mode == "keep":
        assert kept == "True" and int(mmapped) < 64 * 2**20
    else:
        assert int(mmapped) >= 64 * 2**20
