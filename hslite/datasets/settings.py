"""A datamodule's settings, defined once: the recipe's `data` section is these plus what the run reads itself.

Each field's comment is its help (`hslite keys` prints it) and each number its declared range (`hslite.ranges`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hslite.ranges import AT_LEAST_0, AT_LEAST_1, ODD, SHARE, Interval, ranged


@dataclass
class DataSettings:
    """Which scene, how it is preprocessed and split, and how patches are batched."""

    scene: str = "synthetic_tiny"  # registered scene name (`hslite data list`), or the path of your own cube file
    labels: str | None = None  # label raster of your own cube (data.scene=PATH); None for a registered scene
    class_names: list[str] = field(default_factory=list)  # your classes, ascending code order; [] means "class <code>"
    wavelengths: str | None = None  # text/.npy file of your cube's band centres, nm; None means its header's, if any
    # code of unlabelled pixels in data.labels (any code of a ≤ 32-bit integer raster); the others become classes 1..C
    ignore_label: int = ranged(0, Interval(-(2**31), 2**32 - 1, whole=True))
    root: str | None = None  # folder holding <scene>/<file>; None means $HSLITE_DATA or the user cache dir
    download: bool = False  # fetch missing files from the scene's canonical URL (checksummed)
    drop_water_bands: bool = True  # drop the scene's conventional water-absorption bands (raw cubes only)
    remove_bands: list[int] = ranged([], AT_LEAST_0)  # extra 0-based band indices to drop; [] means none
    remove_ranges_nm: list[list[float]] = ranged([], AT_LEAST_0)  # [[lo, hi], ...] wavelength ranges to drop, nm
    normalisation: str = "zscore"  # per-band "zscore", "stretch2" (2% linear stretch) or "none"; fitted on train pixels
    pca_components: int = ranged(0, AT_LEAST_0)  # PCA bands fitted on training pixels; 0 means off
    patch_size: int = ranged(9, ODD)  # odd side of the square patch around each pixel, pixels
    split: str = "stratified"  # "stratified" (fraction per class), "count" (pixels per class) or "disjoint" (blocks)
    train_fraction: float = ranged(0.1, SHARE)  # share of each class's pixels for training (stratified, disjoint)
    val_fraction: float = ranged(0.1, SHARE)  # share for validation; the rest (train + val < 1) is the test set
    train_per_class: int = ranged(0, AT_LEAST_0)  # training pixels per class for split=count (≥ 1 there)
    val_per_class: int = ranged(0, AT_LEAST_0)  # validation pixels per class for split=count
    block_size: int = ranged(0, AT_LEAST_0)  # block side for split=disjoint, pixels; 0 means 4 × patch_size
    split_file: str | None = None  # reuse a saved split.npz instead of drawing one; None means draw from train.seed
    batch_size: int = ranged(64, AT_LEAST_1)  # per-device training batch, samples
    eval_batch_size: int = ranged(1024, AT_LEAST_1)  # batch for validation, test and whole-scene prediction, samples
    augment: bool = False  # random flips and 90° rotations of training patches
    num_workers: int = ranged(0, AT_LEAST_0)  # DataLoader workers; 0 means gather in the training process
    # hold only the labelled pixels' patches (gathered once from the cube, read a block at a time) and map the scene
    # a block at a time, for a cube of which even one float32 copy does not fit; false holds the padded scene
    on_disk: bool = False
