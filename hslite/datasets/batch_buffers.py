"""Batch memory that is reused once no tensor references it: fresh memory costs the kernel a zeroing pass.

A fresh 16 MB batch per step is not free on the CPU: glibc hands memory that a freed batch returned back to the
OS, the kernel zeroes every page on first touch, and with a DataLoader holding two batches at a time that is
every step. benchmarks/patches.py measures it ("vectorised" against "vectorised, fresh batches").
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.utils.data import get_worker_info

_probe = [np.empty(0, np.float32)]
_FREE_REFCOUNT = sys.getrefcount(_probe[0])  # an array referenced by its list only, counted as below


class BufferPool:
    """Hand out float32 tensors backed by numpy arrays that the pool keeps, reusing an array once it is free.

    `torch.from_numpy` keeps a reference to the array for as long as the tensor's storage lives (through any view,
    a `.numpy()` of it or a tensor autograd saved), so an array whose reference count is back to the pool's own is
    referenced by nothing that could still read it. In a DataLoader worker a batch is moved into shared memory on
    its way out, so there the pool allocates plainly. It keeps at most `capacity` arrays (the oldest is forgotten,
    not freed under a user: a tensor still holding it keeps it alive).
    """

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._arrays: list[np.ndarray] = []

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous float32 tensor of `shape` with undefined contents."""
        if get_worker_info() is not None:
            return torch.empty(shape)
        for index in range(len(self._arrays)):
            if self._arrays[index].shape == shape and sys.getrefcount(self._arrays[index]) <= _FREE_REFCOUNT:
                return torch.from_numpy(self._arrays[index])
        if len(self._arrays) == self.capacity:
            self._arrays.pop(0)
        self._arrays.append(np.empty(shape, np.float32))
        return torch.from_numpy(self._arrays[-1])

    def __getstate__(self) -> dict:
        return {"capacity": self.capacity, "_arrays": []}  # a copy of the pool starts empty
