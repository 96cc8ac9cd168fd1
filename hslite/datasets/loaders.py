"""The DataLoader over one of HSIDataModule's datasets: who makes the batches, where, and in which memory.

Where batches are made, for training on a CUDA device:
- `gather_device=None` (the default): on the host, by the C kernel; `pin_memory=True` page-locks them, so that
  Lightning's `non_blocking=True` copy to the GPU overlaps the step instead of waiting for the GPU first. Without
  workers the patches are gathered straight into page-locked memory and only the labels are copied into it (a
  DataLoader that pinned a pageable batch would copy it all again on the training thread); from workers, the
  DataLoader's pinning thread copies each batch once. Page-locks a few batches' worth of host memory for the run.
- `gather_device="cuda"` (or "cuda:N"): the padded cube, coordinates and labels live on the GPU (the padded cube's
  bytes, plus 24 bytes per sample of each set) and batches are gathered there: no patch crosses the bus, only each
  batch's indices. The cube moves at the first gather, in the process that gathers. Needs num_workers=0 (a worker
  cannot use CUDA); `pin_memory` does not apply (no host batches). "cpu" runs the same torch-op gather on the host,
  without the C kernel: for tests and comparisons.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from hslite.datasets.batches.patches import collate_patches
from hslite.datasets.scene_input import ScenePatches, SceneTiles
from hslite.errors import DataError


def patch_loader(
    dataset: Dataset, batch_size: int, shuffle: bool, num_workers: int, pinning: bool, gather_device: str | None
) -> DataLoader:
    """Batches of `dataset`: of `batch_size` samples drawn by a sampler, or as the dataset makes them (the scene's).

    `pinning`: page-locked host batches, for copies to a CUDA device; `gather_device`: where the patches are gathered
    (None: on the host). A setting the box cannot honour is refused in a sentence naming the fix.
    """
    if pinning and not torch.cuda.is_available():
        raise DataError(
            "pin_memory=True page-locks batches for copies to a CUDA device, and torch sees none here: set "
            "pin_memory=False (it is meant for GPU plans only)."
        )
    if isinstance(dataset, SceneTiles):  # batches made by the dataset, from the open cube file
        return DataLoader(dataset, batch_size=None)
    if gather_device is not None and device_type(gather_device) == "cuda" and not torch.cuda.is_available():
        raise DataError(
            f"gather_device={gather_device!r} keeps the cube on a CUDA device, and torch sees none here: set "
            "gather_device=None to gather on the host."
        )
    return DataLoader(
        dataset,
        batch_size=None if isinstance(dataset, ScenePatches) else batch_size,  # it makes its batches
        shuffle=shuffle,
        drop_last=False,
        num_workers=num_workers,
        collate_fn=collate_patches,
        # Patches are gathered straight into page-locked memory; the DataLoader page-locks the rest of a batch
        # (the labels) and, from workers, whole batches, which arrive in shared memory.
        pin_memory=pinning,
        persistent_workers=num_workers > 0,
    )


def device_type(device: str) -> str:
    """The type of a device name ("cuda" of "cuda:1"), or the name itself where it names no device."""
    try:
        return torch.device(device).type
    except RuntimeError:  # not a device name at all
        return device
