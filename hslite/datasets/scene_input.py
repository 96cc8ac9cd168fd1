"""The model's input built from a cube file a block of rows at a time, so a scene costs one float32 copy of it.

What training needs is the padded cube of the bands the model sees (the kept bands, or the PCA components),
normalised: `padded_input` allocates that array once, in the layout the patch gatherer stores, and fills it block by
block; the raw cube is never held whole. Normalisation and PCA are fitted on the training pixels only, which
`training_spectra` reads in the same block-wise way. `plan_input` says what this will cost before anything is read
(`InputPlan.peak_bytes`), for the config check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from hslite.datasets.cube_file import BLOCK_BYTES, CubeFile
from hslite.datasets.own_scene import OwnScene, open_cube_spec, read_wavelengths
from hslite.datasets.patches import PatchGatherer, to_device
from hslite.datasets.preprocess import check_finite, check_pad, kept_bands, patch_radius
from hslite.datasets.scenes import get_scene_spec


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


# Per-pixel arrays a fit holds beside its input while it maps the scene, bytes a pixel: the ground truth (int64), the
# predicted classes by batch and joined (int64 each), and the map's classes and their label codes (int64 each); each
# is one array in fit's code path (run/evaluate.py, run/outputs.py; map.png draws a subsample).
MAP_BYTES_PER_PIXEL = 8 + 2 * 8 + 2 * 8


@dataclass(frozen=True)
class InputPlan:
    """What a fit will hold of a scene, known before anything is read: its shape and the bands the model sees."""

    shape: tuple[int, int, int]  # rows, cols, bands of the cube as read
    kept_bands: int  # bands left after removal
    input_bands: int  # bands the model sees: kept bands, or PCA components
    patch_size: int
    resident: bool  # the reader holds the raw cube whole for the run (a .mat, a registered scene)

    def peak_bytes(self) -> dict[str, int]:
        """Host bytes of the scene at a fit's peak, by part.

        - input: the padded float32 input (`padded_input`), held for the whole run;
        - blocks: one block of raw rows and what `preprocess_block` makes of it, while the input fills;
        - map: `MAP_BYTES_PER_PIXEL` for every pixel of the scene;
        - raw: the raw cube as float32 where the reader holds it whole, else 0.
        """
        rows, cols, bands = self.shape
        r = patch_radius(self.patch_size)
        block_pixels = max(1, min(rows, BLOCK_BYTES // (4 * cols * bands))) * cols
        pca = self.input_bands if self.input_bands != self.kept_bands else 0
        kept = self.kept_bands
        # the raw block, its kept bands (a copy only when bands are removed), the normalised block, and with PCA the
        # centred copy and the components: all alive at once inside preprocess_block
        per_pixel = 4 * bands + (4 * kept if kept < bands else 0) + 4 * kept + (4 * kept + 4 * pca if pca else 0)
        return {
            "input": 4 * self.input_bands * (rows + 2 * r) * (cols + 2 * r),
            "blocks": per_pixel * block_pixels,
            "map": MAP_BYTES_PER_PIXEL * rows * cols,
            "raw": 4 * rows * cols * bands if self.resident else 0,
        }

    def with_input(self, input_bands: int | None = None, patch_size: int | None = None) -> InputPlan:
        """The same scene with fewer bands in (PCA, or band removal) or another patch size."""
        bands = self.input_bands if input_bands is None else input_bands
        return replace(self, input_bands=bands, patch_size=self.patch_size if patch_size is None else patch_size)


def plan_input(
    own_scene: OwnScene | None,
    scene_name: str,
    remove_bands: Sequence[int],
    remove_ranges_nm: Sequence[Sequence[float]],
    drop_water_bands: bool,
    pca_components: int,
    patch_size: int,
) -> InputPlan:
    """The InputPlan of a datamodule's arguments, from the cube's header (own cube) or its spec (registered scene)."""
    if own_scene is not None:
        cube = open_cube_spec(own_scene.cube, "data.scene")
        shape, resident, wavelengths = cube.shape, cube.resident, cube.wavelengths_nm
        if own_scene.wavelengths is not None:
            wavelengths = read_wavelengths(Path(own_scene.wavelengths))
        water: tuple[int, ...] = ()
    else:
        spec = get_scene_spec(scene_name)
        shape, resident, wavelengths = spec.shape, True, spec.wavelengths_nm
        water = spec.water_bands if drop_water_bands else ()
    remove = sorted(set(remove_bands) | set(water))
    _, kept = kept_bands(shape[2], wavelengths, remove, remove_ranges_nm)
    return InputPlan(shape, int(kept.size), pca_components or int(kept.size), patch_size, resident)


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
