"""Batch memory that is reused once no tensor references it: fresh memory costs the kernel a zeroing pass.

A fresh 16 MB batch per step is not free on the CPU: glibc hands memory that a freed batch returned back to the
OS, the kernel zeroes every page on first touch, and with a DataLoader holding two batches at a time that is
every step. benchmarks/patches.py measures it ("vectorised" against "vectorised, fresh batches").

For a CUDA device batches can be page-locked (`pin_memory=True`), so that Lightning's `non_blocking=True` copy is
queued like a kernel instead of waiting for the GPU, and they are gathered straight into page-locked memory rather
than copied into it by the DataLoader (a second pass over every batch on the training thread). A page-locked batch
must not be overwritten while the asynchronous copy still reads it, and a reference count cannot tell: the host
drops its batch as soon as the copy is queued. torch's page-locked allocator can: a copy from its memory records a
CUDA event, and a freed block is handed out again only once that event has passed. It also keeps freed blocks
rather than returning them to the OS, which is the reuse this pool exists for; so a pinning pool asks it for each
batch and keeps no arrays of its own. `to_device` sends a host tensor up the same way.
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
    not freed under a user: a tensor still holding it keeps it alive). With `pin_memory` it hands out page-locked
    tensors from torch's allocator instead (see the module notes), except in a worker, whose batches the DataLoader
    pins on arrival.
    """

    def __init__(self, capacity: int = 4, pin_memory: bool = False):
        self.capacity = capacity
        self.pin_memory = pin_memory
        self._arrays: list[np.ndarray] = []

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous float32 tensor of `shape` with undefined contents."""
        if get_worker_info() is not None:
            return torch.empty(shape)
        if self.pin_memory:
            return torch.empty(shape, pin_memory=True)
        for index in range(len(self._arrays)):
            if self._arrays[index].shape == shape and sys.getrefcount(self._arrays[index]) <= _FREE_REFCOUNT:
                return torch.from_numpy(self._arrays[index])
        if len(self._arrays) == self.capacity:
            self._arrays.pop(0)
        self._arrays.append(np.empty(shape, np.float32))
        return torch.from_numpy(self._arrays[-1])

    def __getstate__(self) -> dict:
        return {"capacity": self.capacity, "pin_memory": self.pin_memory, "_arrays": []}  # a copy starts empty


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host to a CUDA device through page-locked memory, without waiting for the GPU.

    A plain `.to("cuda")` of pageable memory waits for the stream (every kernel queued before it) once it has copied.
    From page-locked memory the copy is queued like a kernel, and torch's page-locked allocator keeps the temporary's
    block until the copy has run (it records an event), so the temporary can be dropped at once.
    """
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
