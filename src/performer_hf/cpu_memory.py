"""Keep freed CPU memory in the process, so that long-sequence tensors stop paying page faults.

glibc's ``malloc`` serves every allocation above its mmap threshold (at most 32 MiB by default) with a fresh
``mmap`` and gives it back to the system on ``free``. A tensor of a long sequence, (1, 12, 64K, 32) float32
is 100 MB, therefore comes back as new pages each time, and the kernel zero-fills every 4 KiB page at its
first touch. On the 2-core machine of ``benchmarks/``, the default encoder's attention call (forward + backward,
12 heads) at 64K tokens took 6.83 s with glibc's defaults and 5.29 s with freed memory kept, and grew 2.31x
from 32K to 64K against 1.98x (``benchmarks/results/model_speed_scaling_hybrid*.md``); without routing, one
such step page-faulted 4.5 GB (1.17 million faults). Every attention method gains, exact SDPA included; the
benchmarks time all arms under the same allocator.

:func:`retain_freed_memory` sets glibc's thresholds so that allocations below 1 GiB are served from, and
freed into, the process's heap, and the heap keeps up to 2 GiB of free memory instead of trimming it: the same
bargain as PyTorch's CUDA caching allocator (memory once used stays reserved for the process). The training
scripts call it for CPU runs; elsewhere it is opt-in. Other allocators (jemalloc, tcmalloc through
``LD_PRELOAD``, as PyTorch's CPU performance guide suggests) do the same by design.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # allocations from 1 GiB up still get their own mapping, returned on free
_TRIM_THRESHOLD = (1 << 31) - 1  # free memory kept at the heap's top before it is returned (mallopt takes an int)


@functools.cache
def retain_freed_memory() -> bool:
    """Keep freed CPU memory in this process for reuse (glibc ``mallopt``); see the module docs.

    Returns:
        True when the allocator took the setting; False where it cannot (not glibc, or glibc refused), with
        a log message. Idempotent: later calls return the first call's result.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("retain_freed_memory: no glibc mallopt here (%s); the allocator is left as it is.", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    accepted = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not accepted:
        logger.info("retain_freed_memory: glibc refused the mmap / trim thresholds; the allocator is unchanged.")
    return accepted
