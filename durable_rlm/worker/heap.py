"""Large buffers go back to the system when freed, so a worker's memory returns to where it was.

A worker handles buffers of megabytes that live for a moment: a REPL snapshot read from a
sandbox and stored (up to SNAPSHOT_MAX_MB), a model reply's body, a frame of stdout. glibc
serves an allocation that large from a private mapping, and gives it back when it is freed,
but only up to a threshold that it raises each time such a mapping is freed (to at most
32 MB): after the first few, buffers of tens of megabytes come from the heap, and a heap
grown for them seldom shrinks. Measured here: six 24 MB snapshots left a worker 206 MB
larger for good. Fixing the threshold at 1 MB keeps every such buffer a mapping of its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt() parameter numbers
MMAP_THRESHOLD_BYTES = 1 << 20

_DONE: list[bool] = []


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold for this process (once); False where there is no glibc."""
    if _DONE:
        return _DONE[0]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        done = False
    if not done:
        log.info("large buffers may stay in the heap after use: no glibc mallopt here")
    _DONE.append(done)
    return done
