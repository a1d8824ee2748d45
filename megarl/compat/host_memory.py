"""Freed host memory kept in the process for reuse (glibc's allocator, which torch's CPU tensors come from).

glibc hands every block over its mmap threshold (at most 32 MB) back to the kernel with ``munmap`` when it is
freed, and the free top of its heap with ``trim``; the next block then takes a page fault for every 4 KiB it
touches. A CPU training step allocates and frees the same shapes over and over. Measured at SmolLM2-135M's update
(one rank's 2,112 tokens, a 49,152-wide vocabulary, one thread; a scratch profile): the same step took 33-39 s with
0.5-1.1 million page faults and 7-15 s of system time, 27.9 s with 29,000 faults once freed memory stayed in the
process; the user time (compute) was the same. In ``benchmarks/rl_step.py --model`` (2 ranks with vLLM) the update
went from 43-46 s to 38.6 s. CUDA's caching allocator does the same for GPU memory.

Freed blocks are reused, but a heap that grows still faults its new pages in, 4 KiB at a time, and fragmentation
makes it grow for a few steps. ``HUGE_PAGES_ENV`` makes torch's CPU allocator ask for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) on every block of 2 MiB or more (``THP_MEM_ALLOC_ENABLE``, read once by torch: it
must be in a process's environment before it starts, so ``megarl train`` passes it to the ranks it starts under
torchrun; a one-rank run in the command's own process does without): in a scratch DP=2 update the faults fell from
50,000-100,000 per step to under 1,000 by the third step (32.2 s -> 30.9 s); in ``rl_step.py --model``, 37.4 s.

``keep_freed_memory`` sets ``M_MMAP_MAX=0`` (the main thread's blocks come from the heap, where freed ones are
reused; other threads' arenas still map blocks over 64 MiB) and ``M_TRIM_THRESHOLD`` to 2 GiB - 1, the most
``mallopt``'s int takes (the heap shrinks only when more than that is free at its top): the process's resident
memory stays near its peak. It does nothing where the C library is not glibc, nor under an allocator preloaded in
its place (tcmalloc, jemalloc: they keep freed memory themselves).
"""

from __future__ import annotations

import ctypes

HUGE_PAGES_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
"""Environment for CPU rank processes: torch's blocks of 2 MiB and more on transparent huge pages."""

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""``mallopt`` parameter numbers (glibc's malloc.h)."""


def keep_freed_memory() -> bool:
    """Keep freed host memory in this process (see the module docstring). Returns whether glibc took both
    settings; False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
