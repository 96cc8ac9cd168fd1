"""Preprocessing of the cube that must not leak test information.

Band removal, normalisation and PCA fitted on training pixels only, reflect padding, and sanity checks on cubes and
labels. Train/val/test splits are in `splits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hslite.errors import DataError

NORMALISATIONS = ("zscore", "stretch2", "none")


# ------------------------------------------------------------------------------------------------------------ bands
def kept_bands(
    num_bands: int,
    wavelengths_nm: np.ndarray | Sequence[float] | None,
    remove_indices: Sequence[int] = (),
    remove_ranges_nm: Sequence[Sequence[float]] = (),
) -> tuple[np.ndarray | None, np.ndarray]:
    """The bands kept of a `num_bands`-band cube, (wavelengths, 0-based indices), after removals by index and range.

    Ranges are inclusive, in nm; `preprocess_block` takes the kept bands from each block as it is read.
    """
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
    return (wavelengths if wavelengths is None or kept.size == num_bands else wavelengths[kept]), kept


def preprocess_block(
    block: np.ndarray, kept: np.ndarray, normaliser: BandNormalizer, pca: PCAReducer | None, first_row: int = 0
) -> np.ndarray:
    """A raw (rows, cols, bands) block -> the model's bands, float32: kept bands, checked finite, normalised, PCA.

    `first_row` is the block's first scene row, so that a NaN is reported where it is in the scene.
    """
    if kept.size < block.shape[-1]:
        block = np.take(block, kept, axis=-1)
    check_finite(block, first_row)
    block = normaliser.transform(block)
    return block if pca is None else pca.transform(block)


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


# ---------------------------------------------------------------------------------------------- padding and checks
def patch_radius(patch_size: int) -> int:
    """Return patch_size // 2, how far a patch reaches from its centre; patch_size must be odd and >= 1."""
    if int(patch_size) != patch_size or patch_size < 1 or patch_size % 2 == 0:
        raise DataError(f"patch_size must be an odd number >= 1 so a patch has a centre pixel; got {patch_size}.")
    return int(patch_size) // 2


def pad_reflect(cube: np.ndarray, patch_size: int) -> np.ndarray:
    """Pad rows and columns of a (H, W, B) cube by patch_size // 2 with reflection, so border pixels get patches."""
    check_pad(cube.shape[0], cube.shape[1], patch_size)
    radius = patch_radius(patch_size)
    return np.pad(cube, ((radius, radius), (radius, radius), (0, 0)), mode="reflect")


def check_pad(rows: int, cols: int, patch_size: int) -> None:
    """Raise a DataError when a rows x cols image cannot be reflect-padded for `patch_size` (odd, below 2·side − 1)."""
    if patch_radius(patch_size) >= min(rows, cols):
        raise DataError(
            f"patch_size={patch_size} is too large for a {rows}x{cols} image; it must be below "
            f"{2 * min(rows, cols) - 1}."
        )


def check_finite(cube: np.ndarray, first_row: int = 0) -> None:
    """Raise a DataError with the count and first (row, col, band) of any NaN or Inf in the cube.

    `first_row` is the scene row of the cube's row 0 when it is a block of a larger scene.
    """
    bad = ~np.isfinite(cube)
    if bad.any():
        row, col, band = (int(i) for i in np.unravel_index(int(np.argmax(bad)), cube.shape))
        first = (row + first_row, col, band)
        raise DataError(
            f"The cube has {int(bad.sum())} NaN/Inf values, the first at (row, col, band) {first}. Remove the bad "
            "bands (data.remove_bands) or repair the file."
        )
