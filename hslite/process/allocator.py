"""Keep freed heap memory in the process, as a caching allocator does, instead of handing it back on every free.

glibc serves an allocation above its mmap threshold (at most 32 MiB by its own growth rule) from a fresh mapping and
unmaps it on free, so a step whose activations are that large page-faults all of them in again, every step: large
evaluation and training batches of the 3-D CNNs ran markedly slower, and the resident peak barely moves with the
memory kept, since it was in use at the peak anyway. PyTorch's CUDA caching allocator keeps GPU memory for the same
reason. `benchmarks/allocator.py` prints both settings side by side on the box at hand.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
KEPT_BYTES = 1 << 30  # allocations up to 1 GiB come from the heap, and up to this much freed heap stays mapped
_kept = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc.

    Only processes hslite owns call it: the CLI, each spawned rank, the pre-flight's contention ranks. Setting either
    threshold turns off glibc's own adjustment of them for good, and nothing reads them back, so a library call
    (`hslite.fit()` in a notebook) leaves the caller's allocator alone and trains with it.
    """
    global _kept
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries: their allocator, untouched
        return False
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES) == 1)
    return _kept


def keeps_freed_memory() -> bool:
    """Whether this process set glibc's thresholds (`keep_freed_memory`): what a probe here is timed with."""
    return _kept


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim); nothing where the C library is not glibc.

    With `keep_freed_memory` a freed array of up to KEPT_BYTES stays mapped, which is what a training step wants and
    what reading a cube block by block does not: blocks of slightly different sizes fragment the kept heap, and it
    grew by about the cube's size over a whole-scene pass. `CubeFile.blocks` and `scene_tiles` call this between
    blocks.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return
