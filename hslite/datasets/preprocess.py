"""Preprocessing that must not leak test information.

Band removal, splits, normalisation and PCA fitted on training pixels only, reflect padding, and sanity checks on
cubes and labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hslite.errors import DataError

NORMALISATIONS = ("zscore", "stretch2", "none")
SPLIT_KINDS = ("stratified", "count", "disjoint")


# ------------------------------------------------------------------------------------------------------------ bands
def select_bands(
    cube: np.ndarray,
    wavelengths_nm: np.ndarray | Sequence[float] | None,
    remove_indices: Sequence[int] = (),
    remove_ranges_nm: Sequence[Sequence[float]] = (),
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Drop bands by 0-based index and by inclusive wavelength ranges; return (cube, wavelengths, kept indices)."""
    num_bands = cube.shape[-1]
    wavelengths = None if wavelengths_nm is None else np.asarray(wavelengths_nm, dtype=np.float64)
    indices = [int(i) for i in remove_indices]
    outside = [i for i in indices if not 0 <= i < num_bands]
    if outside:
        raise DataError(
            f"Band indices {outside} are outside 0..{num_bands - 1} for this {num_bands}-band cube; band indices "
            "count from 0 in the cube as loaded."
        )
    remove = np.zeros(num_bands, dtype=bool)
    remove[indices] = True
    for band_range in remove_ranges_nm:
        if wavelengths is None:
            raise DataError(
                f"Cannot remove the wavelength range {list(band_range)} nm: this scene has no band wavelengths. "
                "Remove bands by index instead (data.remove_bands)."
            )
        if len(band_range) != 2 or band_range[0] > band_range[1]:
            raise DataError(f"A wavelength range must be [low_nm, high_nm] with low <= high; got {list(band_range)}.")
        remove |= (wavelengths >= band_range[0]) & (wavelengths <= band_range[1])
    kept = np.flatnonzero(~remove)
    if kept.size == 0:
        raise DataError(f"The band removal asked for drops all {num_bands} bands; keep at least one.")
    if kept.size == num_bands:
        return cube, wavelengths, kept
    return np.take(cube, kept, axis=-1), None if wavelengths is None else wavelengths[kept], kept


# ---------------------------------------------------------------------------------------------------- normalisation
class BandNormalizer:
    """Per-band normalisation fitted on training pixels.

    Methods: "zscore", "stretch2" (2-98 % linear stretch, clipped to [0, 1]) or "none". Both real methods are
    (x - offset) / scale, so one state serves both.
    """

    def __init__(self, method: str = "zscore"):
        if method not in NORMALISATIONS:
            raise DataError(f"Unknown normalisation {method!r}; choose one of {', '.join(NORMALISATIONS)}.")
        self.method = method
        self.offset: np.ndarray | None = None
        self.scale: np.ndarray | None = None

    def fit(self, pixels: np.ndarray) -> BandNormalizer:
        """Fit per-band statistics on (n, B) training pixels."""
        pixels = _as_pixels(pixels)
        if self.method == "zscore":
            offset, scale = pixels.mean(axis=0), pixels.std(axis=0)
        elif self.method == "stretch2":
            offset, high = np.percentile(pixels, (2.0, 98.0), axis=0)
            scale = high - offset
        else:
            offset, scale = np.zeros(pixels.shape[1]), np.ones(pixels.shape[1])
        self.offset = offset
        self.scale = np.where(scale > 0, scale, 1.0)  # a constant band is centred, not divided by zero
        return self

    def transform(self, cube: np.ndarray) -> np.ndarray:
        """Return a float32 copy of `cube` (..., B) normalised with the fitted statistics."""
        if self.method == "none":
            return np.asarray(cube, dtype=np.float32)
        if self.offset is None or self.scale is None:
            raise DataError(f"BandNormalizer({self.method!r}) must be fitted on training pixels before transform.")
        if cube.shape[-1] != self.offset.size:
            raise DataError(f"The normaliser was fitted on {self.offset.size} bands but the cube has {cube.shape[-1]}.")
        out = np.subtract(cube, self.offset.astype(np.float32), dtype=np.float32)
        out /= self.scale.astype(np.float32)
        if self.method == "stretch2":
            np.clip(out, 0.0, 1.0, out=out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Return the method and statistics as plain lists (fit for a checkpoint or JSON)."""
        return {
            "method": self.method,
            "offset": None if self.offset is None else self.offset.tolist(),
            "scale": None if self.scale is None else self.scale.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if state["method"] not in NORMALISATIONS:
            raise DataError(f"Unknown normalisation {state['method']!r} in the saved state.")
        self.method = state["method"]
        self.offset = None if state["offset"] is None else np.asarray(state["offset"], dtype=np.float64)
        self.scale = None if state["scale"] is None else np.asarray(state["scale"], dtype=np.float64)


class PCAReducer:
    """Principal components of the spectra, fitted (scikit-learn PCA) on training pixels only."""

    def __init__(self, n_components: int):
        if int(n_components) < 1:
            raise DataError(f"pca_components must be >= 1 (0 turns PCA off); got {n_components}.")
        self.n_components = int(n_components)
        self.mean: np.ndarray | None = None
        self.components: np.ndarray | None = None  # (k, B)
        self.explained_variance_ratio: np.ndarray | None = None

    def fit(self, pixels: np.ndarray) -> PCAReducer:
        """Fit on (n, B) training pixels."""
        from sklearn.decomposition import PCA

        pixels = _as_pixels(pixels)
        if self.n_components > min(pixels.shape):
            raise DataError(
                f"pca_components={self.n_components} exceeds what {pixels.shape[0]} training pixels of "
                f"{pixels.shape[1]} bands allow (at most {min(pixels.shape)})."
            )
        pca = PCA(n_components=self.n_components, svd_solver="full").fit(pixels)
        self.mean, self.components = pca.mean_, pca.components_
        self.explained_variance_ratio = pca.explained_variance_ratio_
        return self

    def transform(self, cube: np.ndarray) -> np.ndarray:
        """Project a (..., B) cube onto the fitted components; returns (..., k) float32."""
        if self.mean is None or self.components is None:
            raise DataError("PCAReducer must be fitted on training pixels before transform.")
        flat = cube.reshape(-1, cube.shape[-1]).astype(np.float32, copy=False)
        projected = (flat - self.mean.astype(np.float32)) @ self.components.T.astype(np.float32)
        return projected.reshape(*cube.shape[:-1], self.n_components)

    def state_dict(self) -> dict[str, Any]:
        """Return the fitted mean and components as plain lists."""
        return {
            "n_components": self.n_components,
            "mean": None if self.mean is None else self.mean.tolist(),
            "components": None if self.components is None else self.components.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.n_components = int(state["n_components"])
        self.mean = None if state["mean"] is None else np.asarray(state["mean"], dtype=np.float64)
        self.components = None if state["components"] is None else np.asarray(state["components"], dtype=np.float64)


def _as_pixels(pixels: np.ndarray) -> np.ndarray:
    pixels = np.asarray(pixels, dtype=np.float64)
    if pixels.ndim != 2 or pixels.shape[0] == 0:
        raise DataError(f"Fitting needs a non-empty (pixels, bands) array; got shape {pixels.shape}.")
    return pixels


# ------------------------------------------------------------------------------------------------------------ splits
@dataclass
class Split:
    """Train/val/test (row, col) coordinates of labelled pixels, as (k, 2) int64 arrays."""

    kind: str
    seed: int
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def save(self, path: str | Path) -> None:
        """Save as .npz (kind, seed, train, val, test)."""
        np.savez(Path(path), kind=np.array(self.kind), seed=np.array(self.seed), train=self.train, val=self.val,
                 test=self.test)  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> Split:
        """Load a split written by `save`."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                fields = {key: data[key] for key in ("kind", "seed", "train", "val", "test")}
        except (OSError, ValueError, KeyError) as err:
            raise DataError(
                f"{path} is not a split file written by Split.save ({err}); make it with make_split."
            ) from err
        subsets = {key: np.asarray(fields[key], dtype=np.int64).reshape(-1, 2) for key in ("train", "val", "test")}
        return cls(str(fields["kind"]), int(fields["seed"]), **subsets)

    def counts(self, gt: np.ndarray) -> dict[str, dict[int, int]]:
        """Pixels per class (1..C, C = gt.max()) in each subset: {"train": {1: n, ...}, "val": ..., "test": ...}."""
        num_classes = int(gt.max())
        return {
            name: dict(enumerate(np.bincount(gt[c[:, 0], c[:, 1]], minlength=num_classes + 1)[1:].tolist(), 1))
            for name, c in (("train", self.train), ("val", self.val), ("test", self.test))
        }


def make_split(
    gt: np.ndarray,
    kind: str,
    *,
    train_fraction: float = 0.1,
    val_fraction: float = 0.1,
    train_per_class: int = 0,
    val_per_class: int = 0,
    block_size: int = 0,
    patch_size: int = 1,
    seed: int = 0,
) -> Split:
    """Split the labelled pixels of `gt` into train/val/test.

    "stratified": per-class fractions (scikit-learn). "count": `train_per_class` and `val_per_class` pixels of each
    class, the rest test. "disjoint": square blocks of `block_size` pixels go whole to one subset (balanced per class),
    then val/test pixels closer than 2*(patch_size//2) to a training pixel are dropped, so no training patch overlaps a
    val/test patch.
    """
    if kind not in SPLIT_KINDS:
        raise DataError(f"Unknown split {kind!r}; choose one of {', '.join(SPLIT_KINDS)}.")
    coords = np.argwhere(gt > 0).astype(np.int64)
    labels = gt[gt > 0]
    if coords.size == 0:
        raise DataError("The ground truth has no labelled pixels (all 0), so it cannot be split.")
    rng = np.random.default_rng(seed)
    if kind == "count":
        parts = _count_split(labels, train_per_class, val_per_class, rng)
    else:
        _check_fractions(labels, train_fraction, val_fraction)
        if kind == "stratified":
            parts = _stratified_split(labels, train_fraction, val_fraction, seed)
        else:
            parts = _block_split(gt.shape, coords, labels, train_fraction, val_fraction, block_size, rng)
    _check_every_class_trains(labels, parts[0], kind)
    train, val, test = (coords[np.sort(p)] for p in parts)
    if kind == "disjoint":
        val, test = (_drop_near(subset, train, gt.shape, patch_size) for subset in (val, test))
    return Split(kind, int(seed), train, val, test)


def _check_fractions(labels: np.ndarray, train_fraction: float, val_fraction: float) -> None:
    if not (0 < train_fraction < 1 and 0 <= val_fraction < 1 and train_fraction + val_fraction < 1):
        raise DataError(
            f"train_fraction={train_fraction} and val_fraction={val_fraction} must satisfy 0 < train, 0 <= val and "
            "train + val < 1 (the rest is test)."
        )
    classes, counts = np.unique(labels, return_counts=True)
    for cls, count in zip(classes, counts, strict=True):
        if train_fraction * count < 1:
            raise DataError(
                f"train_fraction={train_fraction} leaves class {cls} ({count} pixels) with no training pixel; "
                f"use train_fraction >= {1 / count:.3g} or a count split (split=count, train_per_class=...)."
            )


def _stratified_split(labels: np.ndarray, train_fraction: float, val_fraction: float, seed: int) -> tuple:
    from sklearn.model_selection import train_test_split

    index = np.arange(labels.size)
    try:
        train, rest = train_test_split(index, train_size=train_fraction, stratify=labels, random_state=seed)
        if val_fraction == 0:
            return train, rest[:0], rest
        val, test = train_test_split(
            rest, train_size=val_fraction / (1 - train_fraction), stratify=labels[rest], random_state=seed
        )
    except ValueError as err:
        raise DataError(f"A stratified split is impossible with these fractions: {err}. Try split=count.") from err
    return train, val, test


def _count_split(labels: np.ndarray, train_per_class: int, val_per_class: int, rng: np.random.Generator) -> tuple:
    if train_per_class < 1 or val_per_class < 0:
        raise DataError(
            f"split=count needs train_per_class >= 1 and val_per_class >= 0; got {train_per_class}, {val_per_class}."
        )
    parts: tuple[list, list, list] = ([], [], [])
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        if members.size <= train_per_class + val_per_class:
            raise DataError(
                f"Class {cls} has {members.size} pixels, too few for train_per_class={train_per_class} + "
                f"val_per_class={val_per_class} with any left to test; lower the counts."
            )
        for part, chunk in zip(
            parts, np.split(members, [train_per_class, train_per_class + val_per_class]), strict=True
        ):
            part.append(chunk)
    return tuple(np.concatenate(part) for part in parts)


def _block_split(shape, coords, labels, train_fraction, val_fraction, block_size, rng) -> tuple:
    if block_size < 1:
        raise DataError(f"split=disjoint needs block_size >= 1 (pixels per block side); got {block_size}.")
    blocks_per_row = -(-shape[1] // block_size)
    block_of_pixel = (coords[:, 0] // block_size) * blocks_per_row + coords[:, 1] // block_size
    blocks, inverse = np.unique(block_of_pixel, return_inverse=True)
    histogram = np.zeros((blocks.size, int(labels.max()) + 1))
    np.add.at(histogram, (inverse, labels), 1)
    fractions = np.array([train_fraction, val_fraction, 1 - train_fraction - val_fraction])
    targets = fractions[:, None] * histogram.sum(axis=0)[None, :]
    assigned = np.zeros_like(targets)
    subset_of_block = np.full(blocks.size, -1, dtype=np.int64)
    order = rng.permutation(blocks.size)
    # First, rarest class first, one block of each class still missing from train goes to train, then one to test
    # (when the class has another block), so a few-block class is not lost to one subset.
    for subset in (0, 2):
        for cls in np.argsort(histogram.sum(axis=0), kind="stable"):
            holders = [b for b in order if histogram[b, cls] > 0 and subset_of_block[b] < 0]
            if cls > 0 and holders and not (subset_of_block[histogram[:, cls] > 0] == subset).any():
                subset_of_block[holders[0]] = subset
                assigned[subset] += histogram[holders[0]]
    # Then greedily: each remaining block, in random order, goes to the subset whose per-class quota it fills most.
    for block in order[subset_of_block[order] < 0]:
        need = np.clip((targets - assigned) / np.maximum(targets, 1e-9), 0, 1) @ histogram[block]
        subset = int(np.argmax(need)) if need.max() > 0 else 2
        subset_of_block[block] = subset
        assigned[subset] += histogram[block]
    subset_of_pixel = subset_of_block[inverse]
    return tuple(np.flatnonzero(subset_of_pixel == s) for s in range(3))


def _check_every_class_trains(labels: np.ndarray, train: np.ndarray, kind: str) -> None:
    classes, counts = np.unique(labels, return_counts=True)
    trained = set(np.unique(labels[train]).tolist())
    for cls, count in zip(classes.tolist(), counts.tolist(), strict=True):
        if cls not in trained:
            hint = "use a smaller block_size or another seed" if kind == "disjoint" else "raise train_fraction"
            raise DataError(f"The {kind} split left class {cls} ({count} pixels) with no training pixel; {hint}.")


def _drop_near(subset: np.ndarray, train: np.ndarray, shape: tuple[int, int], patch_size: int) -> np.ndarray:
    radius = _patch_radius(patch_size)
    if radius == 0 or subset.size == 0:
        return subset
    from scipy.ndimage import binary_dilation

    train_mask = np.zeros(shape, dtype=bool)
    train_mask[train[:, 0], train[:, 1]] = True
    # Two p x p windows overlap when their centres are within 2r (Chebyshev), so dilate by 2r.
    near_train = binary_dilation(train_mask, structure=np.ones((4 * radius + 1, 4 * radius + 1), dtype=bool))
    return subset[~near_train[subset[:, 0], subset[:, 1]]]


# ---------------------------------------------------------------------------------------------- padding and checks
def _patch_radius(patch_size: int) -> int:
    if int(patch_size) != patch_size or patch_size < 1 or patch_size % 2 == 0:
        raise DataError(f"patch_size must be an odd number >= 1 so a patch has a centre pixel; got {patch_size}.")
    return int(patch_size) // 2


def pad_reflect(cube: np.ndarray, patch_size: int) -> np.ndarray:
    """Pad rows and columns of a (H, W, B) cube by patch_size // 2 with reflection, so border pixels get patches."""
    radius = _patch_radius(patch_size)
    if radius >= min(cube.shape[:2]):
        raise DataError(
            f"patch_size={patch_size} is too large for a {cube.shape[0]}x{cube.shape[1]} image; it must be below "
            f"{2 * min(cube.shape[:2]) - 1}."
        )
    return np.pad(cube, ((radius, radius), (radius, radius), (0, 0)), mode="reflect")


def check_finite(cube: np.ndarray) -> None:
    """Raise a DataError with the count and first (row, col, band) of any NaN or Inf in the cube."""
    bad = ~np.isfinite(cube)
    if bad.any():
        first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), cube.shape))
        raise DataError(
            f"The cube has {int(bad.sum())} NaN/Inf values, the first at (row, col, band) {first}. Remove the bad "
            "bands (data.remove_bands) or repair the file."
        )


def check_labels(gt: np.ndarray, num_classes: int) -> None:
    """Raise a DataError when labels fall outside 0..num_classes (0 = unlabelled)."""
    outside = (gt < 0) | (gt > num_classes)
    if outside.any():
        values = np.unique(gt[outside])
        raise DataError(
            f"The ground truth has {int(outside.sum())} pixels with labels {values[:10].tolist()} outside "
            f"0..{num_classes} ({num_classes} classes). The label file does not match the scene's class list."
        )
