"""The model's input built from a cube file a block of rows at a time, so a scene costs one float32 copy of it.

What training needs is the padded cube of the bands the model sees (the kept bands, or the PCA components),
normalised: `padded_input` allocates that array once, in the layout the patch gatherer stores, and fills it block by
block; the raw cube is never held whole. Normalisation and PCA are fitted on the training pixels only, which
`training_spectra` reads in the same block-wise way. With `data.on_disk` not even that copy is made: `patch_bank`
gathers the labelled pixels' patches once, and `SceneTiles` maps the scene a block at a time (`scene_tiles`), as
`hslite predict` does. What each costs is `input_plan`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from hslite.datasets.batches.batch_buffers import to_device
from hslite.datasets.batches.patches import PatchGatherer
from hslite.datasets.preprocess import check_finite, check_pad, patch_radius
from hslite.datasets.scenes.cube_file import BLOCK_BYTES, CubeFile
from hslite.process.allocator import release_freed_memory


def training_spectra(
    source: CubeFile, kept: np.ndarray, coords: np.ndarray, block_bytes: int = BLOCK_BYTES
) -> np.ndarray:
    """(n, kept bands) raw float32 spectra at the (n, 2) (row, col) `coords`, every block of the cube checked finite.

    The whole cube is read (a NaN anywhere is reported before training, as a whole-cube check did).
    """
    out = np.empty((len(coords), kept.size), dtype=np.float32)
    in_rows = _by_row(coords)
    for start, block in source.blocks(block_bytes):
        if kept.size < block.shape[-1]:
            block = np.take(block, kept, axis=-1)
        check_finite(block, start)
        picked = in_rows(start, start + block.shape[0])
        out[picked] = block[coords[picked, 0] - start, coords[picked, 1]]
    return out


def _by_row(coords: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """`in_rows(start, stop)`: the indices of the (n, 2) `coords` whose row is in start..stop-1 (sorted once)."""
    order = np.argsort(coords[:, 0], kind="stable")
    rows = coords[order, 0]

    def in_rows(start: int, stop: int) -> np.ndarray:
        low, high = np.searchsorted(rows, (start, stop))
        return order[low:high]

    return in_rows


def _pixel_coords(index: torch.Tensor, cols: int) -> torch.Tensor:
    """(n, 2) (row, col) of row-major pixel indices in a scene `cols` wide."""
    return torch.stack((index // cols, index % cols), dim=1)


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


def scene_tiles(
    source: CubeFile, transform: Callable[[np.ndarray, int], np.ndarray], patch_size: int, block_rows: int
) -> Iterator[tuple[int, int, PatchGatherer]]:
    """(start, stop, gatherer) down the scene, `block_rows` rows at a time, for mapping it without holding it.

    The gatherer holds rows start..stop-1 through `transform` with a halo of patch_size // 2 rows, reflected where the
    halo runs off the scene as `pad_reflect` pads the whole scene: its patch (row - start, col) is the scene's
    patch (row, col).
    """
    height = source.shape[0]
    radius = patch_radius(patch_size)
    for start in range(0, height, block_rows):
        stop = min(height, start + block_rows)
        low, high = max(0, start - radius), min(height, stop + radius)
        block = transform(source.read(low, high), low)
        rows_pad = (radius - (start - low), radius - (high - stop))
        padded = np.pad(block, (rows_pad, (radius, radius), (0, 0)), mode="reflect")
        yield start, stop, PatchGatherer(padded, patch_size)
        del block, padded
        release_freed_memory()  # the previous tile's arrays, kept by the allocator setting of a training run


def patch_bank(
    source: CubeFile,
    transform: Callable[[np.ndarray, int], np.ndarray],
    num_bands: int,
    patch_size: int,
    coords: np.ndarray,
    block_bytes: int = BLOCK_BYTES,
) -> np.ndarray:
    """The patches around (n, 2) `coords`, gathered once a block at a time, as a (bands, n * p, p) float32 image.

    Patch i is rows i*p..i*p+p-1 of that image: a PatchGatherer over it (bands_first=True) gathers patch i at (i*p, 0),
    so training on a scene that is never held whole costs its labelled pixels' patches, not the scene.
    """
    p = patch_size
    bank = np.empty((num_bands, len(coords), p, p), dtype=np.float32)
    in_rows = _by_row(coords)
    for start, stop, gatherer in scene_tiles(source, transform, p, source.block_rows(block_bytes)):
        picked = in_rows(start, stop)
        if picked.size:
            local = torch.as_tensor(coords[picked] - (start, 0), dtype=torch.long)
            bank[:, picked] = gatherer.gather(local).numpy().transpose(1, 0, 2, 3)
    return bank.reshape(num_bands, len(coords) * p, p)


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


def held_input(
    source: CubeFile,
    transform: Callable[[np.ndarray, int], np.ndarray],
    num_bands: int,
    patch_size: int,
    sets: dict[str, np.ndarray],
    on_disk: bool,
    bands_first: bool,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The one array a fit holds, and where each set's patches are in it.

    The padded scene at the sets' own pixel coordinates, or with `on_disk` the labelled pixels' patches only (a bank,
    bands first), each set at its place there.
    """
    if not on_disk:
        return padded_input(source, transform, num_bands, patch_size, bands_first), sets
    labelled = np.concatenate(list(sets.values()))
    image = patch_bank(source, transform, num_bands, patch_size, labelled)
    bank_at = np.stack([np.arange(len(labelled)) * patch_size, np.zeros(len(labelled), np.int64)], 1)
    ends = np.cumsum([len(coords) for coords in sets.values()])[:-1]
    return image, dict(zip(sets, np.split(bank_at, ends), strict=True))


class ScenePatches(Dataset):
    """Every pixel of a (rows, cols) scene in row-major order, a batch of consecutive pixels per item.

    A PatchDataset of the whole scene would hold 16 bytes of coordinates and 8 of labels per pixel for the whole run;
    here a batch's coordinates are made from its range, and the labels are read from `gt` (classes 1..C, 0
    unlabelled, not copied): -1 where unlabelled, as in PatchDataset. Use with DataLoader(batch_size=None): a sampler
    over pixels would hand out a list of Python ints per batch, and Lightning's predict loop keeps every batch's list
    for the whole pass (tens of bytes a pixel of the scene).
    """

    def __init__(self, gatherer: PatchGatherer, gt: np.ndarray, batch_size: int):
        self.gatherer, self.batch_size = gatherer, batch_size
        self.cols = int(gt.shape[1])
        self.gt = torch.from_numpy(np.ascontiguousarray(gt).reshape(-1))

    def __len__(self) -> int:
        """Batches of `batch_size` pixels, the last one shorter."""
        return -(-int(self.gt.shape[0]) // self.batch_size)

    def __getitem__(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `batch` (x (n, B, p, p) float32, y (n,) int64): pixels batch * batch_size onwards, row * cols + col."""
        start = batch * self.batch_size
        index = torch.arange(start, min(start + self.batch_size, int(self.gt.shape[0])))
        x = self.gatherer.gather(_pixel_coords(index, self.cols))
        return x, to_device(self.gt[index] - 1, x.device)


class SceneTiles(IterableDataset):
    """Every pixel's patch in row-major order, in batches, from a scene read a block at a time (`scene_tiles`).

    For `data.on_disk`: only one block of the scene is held. Yields (x, y) batches of up to `batch_size` pixels, y
    the class - 1 (-1 unlabelled); use with DataLoader(batch_size=None) in the process that made it (the cube file is
    open here).
    """

    def __init__(
        self,
        source: CubeFile,
        transform: Callable[[np.ndarray, int], np.ndarray],
        patch_size: int,
        gt: np.ndarray,
        batch_size: int,
    ):
        self.source, self.transform, self.patch_size, self.batch_size = source, transform, patch_size, batch_size
        self.cols = int(gt.shape[1])
        self.gt = torch.from_numpy(np.ascontiguousarray(gt).reshape(-1))

    def __len__(self) -> int:
        """Batches: a tile's pixels are split into batches of its own."""
        height, step = self.source.shape[0], self.source.block_rows()
        tiles = [min(step, height - start) * self.cols for start in range(0, height, step)]
        return sum(-(-pixels // self.batch_size) for pixels in tiles)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        tiles = scene_tiles(self.source, self.transform, self.patch_size, self.source.block_rows())
        for start, stop, gatherer in tiles:
            for index in torch.arange((stop - start) * self.cols).split(self.batch_size):
                x = gatherer.gather(_pixel_coords(index, self.cols))
                yield x, self.gt[start * self.cols + index] - 1
