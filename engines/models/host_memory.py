"""Host (CPU) memory of an engine process: keep freed blocks for reuse.

glibc's malloc serves every block above its mmap threshold (at most 32 MB) with a fresh `mmap` and
unmaps it on `free`, so each large tensor of a step -- a micro-batch's [B, T, V] logits, activations,
gradients, a rollout's logits -- is faulted in page by page again, every step: ~60 ms per 200 MB
tensor on a 2-core machine. For SmolLM2's GRPO step (8 x 8 samples, 32 new tokens) that was ~0.4 s
of the rollout and ~0.6 s of the update (docs/benchmarks.md, benchmarks/cpu_step_costs.py).
`keep_freed_memory()` turns the mmap path off and turns automatic trimming off, so freed blocks stay
in the heap and the next step reuses them: the process holds its peak heap between steps.
`release_freed_memory()` (`malloc_trim(0)`) still hands free memory back when asked: a generation
engine put to sleep (engines/generation/engine.py `sleep`) and benchmarks/worker_memory.py call it.
"""

from __future__ import annotations

import ctypes
import functools

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc <malloc.h>; mallopt(3): a trim threshold of -1 never trims


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc malloc (Linux) to keep freed memory for reuse; once per process. False where the
    C library is not glibc (nothing changes there)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the OS (glibc `malloc_trim(0)`); False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def release_allocator_caches() -> None:
    """Hand every allocator's freed blocks back: CUDA's caching allocator (a no-op where CUDA was never
    initialised) and glibc's heap. A sleeping generation engine and a trainer between steps call it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    release_freed_memory()
