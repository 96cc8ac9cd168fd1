"""A cube opened for reading a block of rows at a time (`CubeFile`), so a file larger than memory is never held whole.

`io.open_cube` opens the formats; a memory-mapped file (`.npy`, ENVI through spectral) hands back the pages of each
block it read (`released`), so that reading a whole cube by blocks keeps one block resident, not the file.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hslite.errors import DataError
from hslite.process.allocator import release_freed_memory

BLOCK_BYTES = 64 * 2**20  # raw cube bytes per block of rows: big enough that a read is at disk speed


@dataclass(frozen=True)
class CubeFile:
    """A cube opened for reading blocks of rows on demand, so a file larger than memory is never held whole.

    `dtype` is the type on disk and `wavelengths_nm` the band centres its header gives (ENVI), if any; `read` returns
    (rows, cols, bands) float32 whatever the layout on disk.
    """

    source: str
    shape: tuple[int, int, int]
    dtype: np.dtype
    crs: Any
    transform: Any
    wavelengths_nm: np.ndarray | None
    rows: Callable[[int, int], np.ndarray]  # (start, stop) -> rows start..stop-1 as stored, (r, cols[, bands])
    resident: bool = True  # the whole cube is held in memory (an array, a .mat); False: read from the file per block

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop-1 (by default all of them) as a contiguous float32 (rows, cols, bands) array."""
        block = self.rows(start, self.shape[0] if stop is None else stop)
        return np.ascontiguousarray(block.reshape(-1, *self.shape[1:]), dtype=np.float32)

    def block_rows(self, block_bytes: int = BLOCK_BYTES) -> int:
        """Rows per block so that a block holds about `block_bytes` of the cube as float32 (at least one row)."""
        return max(1, min(self.shape[0], block_bytes // (4 * self.shape[1] * self.shape[2])))

    def blocks(self, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, float32 block) over the whole cube, top to bottom, `block_rows(block_bytes)` rows each."""
        step = self.block_rows(block_bytes)
        for start in range(0, self.shape[0], step):
            yield start, self.read(start, min(self.shape[0], start + step))
            release_freed_memory()  # the previous block's arrays, kept by the allocator setting of a training run


def cube_from_array(array: np.ndarray, source: str, crs: Any = None, transform: Any = None) -> CubeFile:
    """A CubeFile over an array already in memory ((rows, cols) is one band)."""
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.dtype.kind not in "biuf":
        raise DataError(f"{source} holds {array.dtype} data of shape {array.shape}; a cube is (rows, cols, bands).")
    rows, cols, bands = (int(n) for n in array.shape)
    return CubeFile(source, (rows, cols, bands), array.dtype, crs, transform, None, lambda a, b: array[a:b])


def npy_cube(array: np.ndarray, source: str) -> CubeFile:
    """A `.npy` cube as np.load(mmap_mode="r") maps it, each block copied out and its pages handed back (`released`)."""
    mapped = cube_from_array(array, source)
    copied = lambda start, stop: np.array(mapped.rows(start, stop), dtype=np.float32)  # noqa: E731
    return CubeFile(**{**mapped.__dict__, "rows": released(copied, array), "resident": False})


def released(rows: Callable[[int, int], np.ndarray], mapped: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """`rows`, which copies a block out of the memory map `mapped`, then drops the map's pages from this process.

    A mapped page that was read stays in the process's resident set until the kernel needs the memory back, so a
    cube read through a map is counted (and reported by `time -v`, and limited by a cgroup) as a second copy of
    everything read. MADV_DONTNEED unmaps them; they stay in the page cache, so reading them again costs no disk.
    """
    handle = getattr(mapped, "_mmap", None)  # np.memmap keeps its mmap.mmap here; numpy has no public accessor

    def read(start: int, stop: int) -> np.ndarray:
        block = rows(start, stop)
        if isinstance(handle, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            handle.madvise(mmap.MADV_DONTNEED)
        return block

    return read
