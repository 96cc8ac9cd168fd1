"""Keep freed heap memory in the process, as a caching allocator does, instead of handing it back on every free.

glibc serves an allocation above its mmap threshold (at most 32 MiB by its own growth rule) from a fresh mapping and
unmaps it on free, so a step whose activations are that large page-faults all of them in again, every step. The 3-D
CNN of Salinas-A (20 components, 9×9 patches, as its recipe then was) evaluated 1,890 samples/s at a batch of 1,024
against 3,330 with the memory kept, and trained at 533 against 641 samples/s (whole command 58 s against 47 s, same
accuracy; 2-core EPYC, torch 2.13). The resident peak barely moves (764 against 777 MB): the memory was in use at
the peak anyway. PyTorch's CUDA caching allocator keeps GPU memory for the same reason. `benchmarks/allocator.py`
prints both settings side by side (1.8-2.1x at batches of 1,024 and more; within noise at 64-256).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
KEPT_BYTES = 1 << 30  # allocations up to 1 GiB come from the heap, and up to this much freed heap stays mapped


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc.

    Every process that trains or is timed calls it (the CLI, `fit`, each spawned rank, the pre-flight's contention
    ranks), so what the pre-flight measures is what training runs.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries: their allocator, untouched
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES) == 1)


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
