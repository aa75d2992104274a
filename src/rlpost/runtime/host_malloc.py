"""A long-sequence policy worker maps its large host buffers on their own, so freed activations leave the process.

glibc serves an allocation from its own mmap only above a threshold that starts at 128 KiB and, by default, rises to
the size of each mapped block freed (up to 32 MiB). After a training step has freed its activations, the next
step's (tens of MiB each at thousands of tokens) come from the heap instead, and the heap keeps freed pages in its
arenas and fragments: a worker's RSS then carries one phase's high-water mark into the next. At long sequences that
is most of a step's peak (docs/benchmarks.md, the long-context rows).

`map_large_buffers()` fixes the threshold at `MMAP_THRESHOLD` (a fixed value also stops it rising), which is the
MALLOC_MMAP_THRESHOLD_ environment variable set from inside the process: every buffer of a MiB or more is mapped on
its own and unmapped when freed. The price is a page fault per page of every such buffer each time it is made,
which on a small model's short-sequence step (a few MiB of gradients and optimizer temporaries, many times a step)
costs several percent, so the workers turn it on only for a policy whose sequences reach
`rlpost.config.layout.LONG_SEQUENCE_TOKENS` (`maps_large_buffers` there, which the memory plan reads too). It does
nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h)."""
MMAP_THRESHOLD = 1 << 20
"""Buffers of this many bytes or more are mapped on their own: 1 MiB, far above Python's small objects."""


def map_large_buffers(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; whether it took (False off glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
