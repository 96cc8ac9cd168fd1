"""What a fit will hold of a scene, known before a pixel of the cube is read: `plan_input` -> `InputPlan`.

The config check (hslite/recipe/memory_check.py) adds up `InputPlan.peak_bytes` to refuse a scene that would not fit
in host memory, and tries other settings (`with_input`) to say which would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hslite.datasets.preprocess import kept_bands, patch_radius
from hslite.datasets.scenes.cube_file import BLOCK_BYTES
from hslite.datasets.scenes.io import read_labels
from hslite.datasets.scenes.own_scene import OwnScene, open_cube_spec, read_wavelengths, split_key
from hslite.datasets.scenes.registry import get_scene_spec

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
    on_disk: bool = False  # data.on_disk: the labelled pixels' patches are held, not the scene
    labelled: int = 0  # labelled pixels (train + val + test), whose patches data.on_disk holds

    def peak_bytes(self) -> dict[str, int]:
        """Host bytes of the scene at a fit's peak, by part.

        - input: the padded float32 input (`padded_input`), or with `on_disk` the labelled pixels' patches
          (`patch_bank`), held for the whole run;
        - blocks: one block of raw rows and what `preprocess_block` makes of it, while the input fills; with
          `on_disk` also the block padded and stored band-major (`scene_tiles`), while the scene is mapped;
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
        if self.on_disk:
            per_pixel += 2 * 4 * self.input_bands
            held = 4 * self.input_bands * self.patch_size**2 * self.labelled
        else:
            held = 4 * self.input_bands * (rows + 2 * r) * (cols + 2 * r)
        return {
            "input": held,
            "blocks": per_pixel * block_pixels,
            "map": MAP_BYTES_PER_PIXEL * rows * cols,
            "raw": 4 * rows * cols * bands if self.resident else 0,
        }

    def with_input(self, **changes: int | bool) -> InputPlan:
        """The same scene with other input_bands (PCA, or band removal), patch_size or on_disk."""
        return replace(self, **changes)  # type: ignore[arg-type]


def plan_input(
    own_scene: OwnScene | None,
    scene_name: str,
    remove_bands: Sequence[int],
    remove_ranges_nm: Sequence[Sequence[float]],
    drop_water_bands: bool,
    pca_components: int,
    patch_size: int,
    on_disk: bool,
) -> InputPlan:
    """The InputPlan of a datamodule's arguments, from the cube's header (own cube) or its spec (registered scene).

    Reads no pixel of the cube; the label raster is counted (read whole, then dropped) for the labelled pixels.
    """
    wavelengths: np.ndarray | Sequence[float] | None
    if own_scene is not None:
        cube = open_cube_spec(own_scene.cube, "data.scene")
        shape, resident, wavelengths = cube.shape, cube.resident, cube.wavelengths_nm
        if own_scene.wavelengths is not None:
            wavelengths = read_wavelengths(Path(own_scene.wavelengths))
        water: tuple[int, ...] = ()
        path, key = split_key(own_scene.labels)
        labelled = int(np.count_nonzero(read_labels(path, key, key is not None) != own_scene.ignore_label))
    else:
        spec = get_scene_spec(scene_name)
        shape, resident, wavelengths = spec.shape, True, spec.wavelengths_nm
        water = spec.water_bands if drop_water_bands else ()
        labelled = sum(spec.class_counts) if spec.class_counts else shape[0] * shape[1]  # at most every pixel
    remove = sorted(set(remove_bands) | set(water))
    _, kept = kept_bands(shape[2], wavelengths, remove, remove_ranges_nm)
    return InputPlan(shape, int(kept.size), pca_components or int(kept.size), patch_size, resident, on_disk, labelled)
