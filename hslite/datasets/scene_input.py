"""The model's input built from a cube file a block of rows at a time, so a scene costs one float32 copy of it.

What training needs is the padded cube of the bands the model sees (the kept bands, or the PCA components),
normalised: `padded_input` allocates that array once, in the layout the patch gatherer stores, and fills it block by
block; the raw cube is never held whole. Normalisation and PCA are fitted on the training pixels only, which
`training_spectra` reads in the same block-wise way. `peak_bytes` is what this costs, for the config check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from hslite.datasets.cube_file import BLOCK_BYTES, CubeFile
from hslite.datasets.patches import PatchGatherer, to_device
from hslite.datasets.preprocess import check_finite, check_pad, patch_radius


def training_spectra(
    source: CubeFile, kept: np.ndarray, coords: np.ndarray, block_bytes: int = BLOCK_BYTES
) -> np.ndarray:
    """(n, kept bands) raw float32 spectra at the (n, 2) (row, col) `coords`, every block of the cube checked finite.

    The whole cube is read (a NaN anywhere is reported before training, as a whole-cube check did).
    """
    out = np.empty((len(coords), kept.size), dtype=np.float32)
    order = np.argsort(coords[:, 0], kind="stable")
    rows = coords[order, 0]
    for start, block in source.blocks(block_bytes):
        if kept.size < block.shape[-1]:
            block = np.take(block, kept, axis=-1)
        check_finite(block, start)
        low, high = np.searchsorted(rows, (start, start + block.shape[0]))
        picked = order[low:high]
        out[picked] = block[coords[picked, 0] - start, coords[picked, 1]]
    return out


def padded_input(
    source: CubeFile,
    transform: Callable[[np.ndarray, int], np.ndarray],
    num_bands: int,
    patch_size: int,
    bands_first: bool,
    block_bytes: int = BLOCK_BYTES,
) -> np.ndarray:
    """The whole scene through `transform`, reflect-padded by patch_size // 2 as `pad_reflect` pads, in one array.

    `transform(block, first_row)` turns a raw block into its (rows, cols, num_bands) float32 input. The array is
    (bands, rows, cols) when `bands_first`, else (rows, cols, bands).
    """
    height, width = source.shape[:2]
    check_pad(height, width, patch_size)
    r = patch_radius(patch_size)
    shape = (num_bands, height + 2 * r, width + 2 * r) if bands_first else (height + 2 * r, width + 2 * r, num_bands)
    out = np.empty(shape, dtype=np.float32)
    pixels = out.transpose(1, 2, 0) if bands_first else out  # (rows, cols, bands) view of either layout
    for start, block in source.blocks(block_bytes):
        pixels[r + start : r + start + block.shape[0], r : r + width] = transform(block, start)
    reflect_edges(pixels, r)
    return out


def reflect_edges(pixels: np.ndarray, radius: int) -> None:
    """Fill the `radius`-wide border of a padded (rows, cols, ...) array in place by reflection about its edge pixels.

    np.pad(mode="reflect") does the same to a copy: rows first, then columns over the full padded height, so the
    corners match.
    """
    rows, cols = pixels.shape[0] - 2 * radius, pixels.shape[1] - 2 * radius
    for k in range(1, radius + 1):
        pixels[radius - k] = pixels[radius + k]
        pixels[radius + rows - 1 + k] = pixels[radius + rows - 1 - k]
    for k in range(1, radius + 1):
        pixels[:, radius - k] = pixels[:, radius + k]
        pixels[:, radius + cols - 1 + k] = pixels[:, radius + cols - 1 - k]


def peak_bytes(shape: tuple[int, int, int], input_bands: int, patch_size: int, pca: bool) -> dict[str, int]:
    """Host bytes a fit of a (rows, cols, bands) scene holds at its peak, by part (the config check adds them up).

    - input: the padded float32 input (`padded_input`), held for the whole run;
    - blocks: one raw block, its kept bands, the normalised block and (PCA) its centred copy, while the input fills;
    - pixels: per-pixel bookkeeping of the whole scene: the int64 label map as read and as classes, the map's
      coordinates (2 × int64) and labels, and its predicted classes (int64), 48 bytes a pixel.
    """
    rows, cols, bands = shape
    r = patch_radius(patch_size)
    block_rows = max(1, min(rows, BLOCK_BYTES // (4 * cols * bands)))
    block_floats = block_rows * cols * (3 * bands + (bands if pca else 0))
    return {
        "input": 4 * input_bands * (rows + 2 * r) * (cols + 2 * r),
        "blocks": 4 * block_floats,
        "pixels": 48 * rows * cols,
    }


class ScenePatches(Dataset):
    """Every pixel of a (rows, cols) scene in row-major order, its coordinates made per batch from the indices.

    A PatchDataset of the whole scene would hold 16 bytes of coordinates and 8 of labels per pixel for the whole run;
    here a batch's are computed from its indices, and the labels are read from `gt` (classes 1..C, 0 unlabelled,
    not copied): -1 where unlabelled, as in PatchDataset.
    """

    def __init__(self, gatherer: PatchGatherer, gt: np.ndarray):
        self.gatherer = gatherer
        self.cols = int(gt.shape[1])
        self.gt = torch.from_numpy(np.ascontiguousarray(gt).reshape(-1))

    def __len__(self) -> int:
        return int(self.gt.shape[0])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the batch (x (n, B, p, p) float32, y (n,) int64) for these pixel indices (row * cols + col)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        x = self.gatherer.gather(torch.stack((index // self.cols, index % self.cols), dim=1))
        return x, to_device(self.gt[index] - 1, x.device)
