"""Vectorised patch extraction: the padded cube lives once as a tensor and a batch of patches is one gather.

Layout and speed (benchmarks/patches.py, one thread, IP-sized scene, 9x9 patches, batch 256): in the default
contiguous (n, B, p, p) layout a batch is n*B*p rows of p floats, copied by ONE `index_select` from an overlapping
strided view of the band-major cube (the offset grid is the view's strides plus a (B*p,) offset vector): ~55-58k
samples/s, 1.8x a per-sample loader, ~60 % of copy bandwidth. Short rows are the limit. With `channels_last=True` the
cube is pixel-major and a batch is n*p*p whole spectra (B floats each), returned with the same (n, B, p, p) shape and
NHWC strides: ~95-135k samples/s (3-4x), useful for models whose first layer takes channels-last input.

Buffers: `gather(coords, out=...)` fills a caller's buffer, but `PatchDataset` allocates a fresh tensor per batch.
A DataLoader may hold several batches at once (Lightning prefetches one; worker batches travel through shared
memory that the consumer maps), so a recycled buffer could be overwritten while a model still reads it. Fresh
allocation cost 3-8 % against a reused buffer, so safety wins.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from hslite.errors import DataError


class PatchGatherer:
    """Hold a padded (H+2r, W+2r, B) cube once as a tensor and gather p x p patches around (row, col) centres.

    Coordinates are those of the unpadded image: patch (row, col) covers padded rows row..row+p-1. With
    `channels_last=False` (default) patches come back contiguous; with True, as NHWC-strided (n, B, p, p) tensors.
    """

    def __init__(
        self,
        padded_cube: torch.Tensor | np.ndarray,
        patch_size: int,
        device: str | torch.device = "cpu",
        channels_last: bool = False,
    ):
        cube = torch.as_tensor(padded_cube, dtype=torch.float32)
        if cube.ndim != 3 or patch_size < 1 or patch_size % 2 == 0 or min(cube.shape[:2]) < patch_size:
            raise DataError(
                f"PatchGatherer needs a padded (rows, cols, bands) cube and an odd patch_size no larger than it; got "
                f"shape {tuple(cube.shape)} and patch_size {patch_size}."
            )
        self.patch_size = int(patch_size)
        self.channels_last = bool(channels_last)
        self.padded_rows, self.padded_cols, self.num_bands = (int(s) for s in cube.shape)
        self.rows = self.padded_rows - self.patch_size + 1
        self.cols = self.padded_cols - self.patch_size + 1
        self.device = torch.device(device)
        p, plane = self.patch_size, self.padded_rows * self.padded_cols
        if self.channels_last:
            self.storage = cube.reshape(plane, self.num_bands).to(self.device).contiguous()  # one spectrum per row
            offsets = torch.arange(p)[:, None] * self.padded_cols + torch.arange(p)[None, :]
        else:
            self.storage = cube.permute(2, 0, 1).to(self.device).contiguous()  # (B, H+2r, W+2r)
            offsets = torch.arange(self.num_bands)[:, None] * plane + torch.arange(p)[None, :] * self.padded_cols
        self.offsets = offsets.reshape(-1).to(self.device)  # (p*p,) or (B*p,) flat offsets from a patch's corner
        self._rows_view: torch.Tensor | None = None

    def _view(self) -> torch.Tensor:
        # Built lazily (and dropped when pickled): row a of the view is the p floats starting at flat position a.
        if self._rows_view is None:
            if self.channels_last:
                self._rows_view = self.storage
            else:
                flat = self.storage.reshape(-1)
                p = self.patch_size
                self._rows_view = flat.as_strided((flat.numel() - p + 1, p), (1, 1))
        return self._rows_view

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_rows_view"] = None
        return state

    @property
    def nbytes_per_patch(self) -> int:
        """Bytes of one gathered (B, p, p) float32 patch."""
        return 4 * self.num_bands * self.patch_size**2

    def gather(self, coords: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Return the (n, B, p, p) float32 patches centred on `coords` (n, 2) long (row, col), in `out` if given.

        Coordinates are not range-checked here (PatchDataset checks them once); out-of-range ones raise or wrap.
        """
        coords = coords.to(self.device, torch.long)
        n, b, p = coords.shape[0], self.num_bands, self.patch_size
        corners = coords[:, 0] * self.padded_cols + coords[:, 1]
        index = (corners[:, None] + self.offsets[None, :]).reshape(-1)
        if out is None:
            memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
            out = torch.empty((n, b, p, p), dtype=torch.float32, device=self.device, memory_format=memory_format)
        if tuple(out.shape) != (n, b, p, p) or out.dtype != torch.float32:
            raise DataError(
                f"out must be a float32 tensor of shape {(n, b, p, p)}; got {out.dtype} {tuple(out.shape)}."
            )
        rows_out = out.permute(0, 2, 3, 1) if self.channels_last else out
        torch.index_select(self._view(), 0, index, out=rows_out.view(-1, b if self.channels_last else p))
        return out


def _dihedral_permutations(patch_size: int, device: torch.device) -> torch.Tensor:
    grid = torch.arange(patch_size * patch_size, device=device).view(patch_size, patch_size)
    turns = [torch.rot90(grid, k, (0, 1)) for k in range(4)]
    return torch.stack([t.reshape(-1) for t in turns + [t.flip(1) for t in turns]])  # (8, p*p)


def augment_batch(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Apply to each sample one of the 8 flips/rotations of the square (chosen by `generator`), in one gather.

    Keeps the shape (n, B, p, p) and the memory layout (contiguous or channels-last) of `x`.
    """
    n, bands, p, _ = x.shape
    choice = torch.randint(0, 8, (n,), generator=generator, device=generator.device).to(x.device)
    permutation = _dihedral_permutations(p, x.device)[choice]  # (n, p*p): output pixel m reads input pixel perm[m]
    if x.is_contiguous():
        flat = x.reshape(n, bands, p * p)
        return flat.gather(2, permutation[:, None, :].expand(n, bands, p * p)).view(n, bands, p, p)
    flat = x.permute(0, 2, 3, 1).reshape(n, p * p, bands)
    return flat.gather(1, permutation[:, :, None].expand(n, p * p, bands)).view(n, p, p, bands).permute(0, 3, 1, 2)


class PatchDataset(Dataset):
    """Patches around labelled pixels; `__getitems__` returns a whole batch from one gather.

    Labels are zero-based (class - 1), or -1 for unlabelled pixels in prediction sets. Use with
    `DataLoader(..., collate_fn=collate_patches)`.
    """

    def __init__(
        self,
        gatherer: PatchGatherer,
        coords: np.ndarray | torch.Tensor,
        labels: np.ndarray | torch.Tensor,
        augment: bool = False,
        seed: int = 0,
    ):
        self.gatherer = gatherer
        self.coords = torch.as_tensor(np.asarray(coords), dtype=torch.long).reshape(-1, 2)
        self.labels = torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1)
        if self.coords.shape[0] != self.labels.shape[0]:
            raise DataError(f"{self.coords.shape[0]} coordinates but {self.labels.shape[0]} labels; they must pair up.")
        if self.coords.numel() and (
            self.coords.min() < 0
            or self.coords[:, 0].max() >= gatherer.rows
            or self.coords[:, 1].max() >= gatherer.cols
        ):
            raise DataError(f"Patch coordinates fall outside the {gatherer.rows}x{gatherer.cols} image.")
        self.augment = augment
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._generator_worker: int | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the batch (x (n, B, p, p) float32, y (n,) int64) for these sample indices."""
        index = torch.as_tensor(indices, dtype=torch.long)
        x = self.gatherer.gather(self.coords[index])
        if self.augment:
            x = augment_batch(x, self._augment_generator())
        return x, self.labels[index]

    def _augment_generator(self) -> torch.Generator:
        # Each worker is a copy of this dataset: reseed from the worker's own seed (new every epoch, derived from the
        # main process RNG) so workers and epochs do not repeat each other's flips.
        info = get_worker_info()
        if info is not None and self._generator_worker != info.seed:
            self._generator.manual_seed(info.seed)
            self._generator_worker = info.seed
        return self._generator


def collate_patches(batch: Any) -> Any:
    """Pass through the (x, y) batch that `PatchDataset.__getitems__` already built (module-level so it pickles)."""
    return batch
