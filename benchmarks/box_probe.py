"""How fast this machine is right now, in the ways the GRPO benchmark's steps depend on it.

    python benchmarks/box_probe.py [--threads 2]      # JSON on stdout, one line for people on stderr

`flyroll bench` runs it before and after the comparison and prints and stores both (`box` in its
JSON), because the same code's step times move by tens of percent over a day on a shared VM, and
not alike for both systems (docs/benchmarks.md). Measured, best or median of a few repeats
(a few seconds in all):
- `gemm_gflops`: float32 [768, 576] x [576, 1536] products (a SmolLM2 MLP projection of one
  micro-batch) on `--threads` torch threads: the compute rate.
- `copy_gbps`: copying a 256 MiB float32 tensor into another, bytes read + written per second: the
  memory bandwidth the element-wise passes see.
- `fault_s_per_gib`: first write to each 4 KiB page of 1 GiB of newly mapped memory, minus the
  same writes once the pages are there: what a step pays per GiB it allocates afresh (a process
  that gave its memory back, or glibc mapping each large tensor anew). On this VM it was 0.43-0.65
  s/GiB (1.6-2.5 us a page) on 2026-12-01 evening; its kernel reports free memory to the host
  (virtio-balloon free page reporting), so memory that sat free comes back through a host fault.
- `free_page_reporting`: whether that kernel module is active here (None: not readable).
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

GIB = 1 << 30


def gemm_gflops(threads: int, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(768, 576), torch.randn(1536, 576).t()
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * 768 * 576 * 1536 / best / 1e9


def copy_gbps(threads: int, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def fault_s_per_gib() -> float:
    """Seconds to write one byte into each page of a fresh 1 GiB anonymous mapping, less the time
    of the same writes once the pages are mapped."""
    import numpy as np

    m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = np.frombuffer(m, dtype=np.uint8)
        t0 = time.perf_counter()
        view[:: mmap.PAGESIZE] = 1
        t1 = time.perf_counter()
        view[:: mmap.PAGESIZE] = 2
        t2 = time.perf_counter()
        return (t1 - t0) - (t2 - t1)
    finally:
        del view
        m.close()


def free_page_reporting() -> bool | None:
    try:
        with open("/sys/module/page_reporting/parameters/reported_kib") as f:
            return int(f.read()) > 0
    except (OSError, ValueError):
        return None


def probe(threads: int = 2, repeats: int = 3) -> dict:
    faults = [fault_s_per_gib() for _ in range(repeats)]
    return {"gemm_gflops": gemm_gflops(threads), "copy_gbps": copy_gbps(threads),
            "fault_s_per_gib": statistics.median(faults), "free_page_reporting": free_page_reporting(),
            "threads": threads, "load_average": os.getloadavg()[0]}


def describe(p: dict) -> str:
    """One line for people."""
    return (f"GEMM {p['gemm_gflops']:.0f} GFLOP/s ({p['threads']} threads), copy {p['copy_gbps']:.1f} GB/s, "
            f"page faults {p['fault_s_per_gib']:.2f} s/GiB, load average {p['load_average']:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    result = probe(args.threads)
    print(json.dumps(result))
    print(describe(result), file=sys.stderr)
