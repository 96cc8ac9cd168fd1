"""Deterministic synthetic scenes: fields of classes whose pixels are noisy linear mixtures of plausible spectra.

A scene is a Voronoi partition into fields; labelled classes occupy the interiors of some fields (their margins stay
unlabelled, like hand-drawn ground truth). Each class is a mean mixture of a few endmembers (green and dry vegetation,
soils, water, a man-made surface) over 400-2500 nm; each field perturbs that mixture, each pixel draws its own
mixture around the field's, and illumination and sensor noise are added. Classes therefore overlap spectrally, and a
model that looks at neighbours does better than one that looks at a pixel alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.spatial import cKDTree

from hslite.errors import DataError

_PIXELS_PER_FIELD = 200  # average Voronoi cell area; Indian Pines fields are a few hundred pixels
FIELD_CONCENTRATION = 60.0  # Dirichlet concentration of a field's mixture around its class mean (higher = tighter)
_PIXEL_CONCENTRATION = 120.0  # same, of a pixel around its field


def _gaussian(wavelengths_nm: np.ndarray, centre_nm: float, width_nm: float) -> np.ndarray:
    return np.exp(-0.5 * ((wavelengths_nm - centre_nm) / width_nm) ** 2)


def endmember_spectra(wavelengths_nm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Return (7, B) reflectance spectra of green vegetation (2), dry vegetation, soil (bright, dark), water, concrete.

    Shapes follow textbook signatures: chlorophyll absorption and a red edge near 700-730 nm, leaf-water dips at 970,
    1200, 1450 and 1940 nm, a rising soil continuum with a clay feature at 2200 nm, water dark beyond 700 nm. Parameters
    are jittered by `rng` so each seed gives slightly different materials.
    """
    w = wavelengths_nm
    water_dips = 1 - 0.55 * _gaussian(w, 1450, 60) - 0.7 * _gaussian(w, 1940, 70) - 0.12 * _gaussian(w, 970, 25)
    water_dips -= 0.18 * _gaussian(w, 1200, 35)

    def vegetation(edge_nm: float, nir: float, green: float) -> np.ndarray:
        visible = 0.04 + green * _gaussian(w, 550, 35) - 0.02 * _gaussian(w, 670, 20)
        plateau = nir / (1 + np.exp(-(w - edge_nm) / 14))
        decline = np.where(w > 1300, 1 - 0.35 * (w - 1300) / 1200, 1.0)
        return (visible + plateau * decline) * water_dips

    def soil(brightness: float, slope: float) -> np.ndarray:
        continuum = brightness * (1 + slope * (w - 400) / 2100)
        return continuum * (1 - 0.15 * _gaussian(w, 2200, 30)) * (1 - 0.3 * (1 - water_dips))

    jitter = rng.uniform(-1, 1, size=8)
    spectra = [
        vegetation(705 + 8 * jitter[0], 0.42 + 0.05 * jitter[1], 0.07),
        vegetation(725 + 8 * jitter[2], 0.52 + 0.05 * jitter[3], 0.10),
        soil(0.22 + 0.03 * jitter[4], 0.9) * (1 - 0.12 * _gaussian(w, 2100, 40)) + 0.05 * _gaussian(w, 760, 60),
        soil(0.28 + 0.03 * jitter[5], 1.3),
        soil(0.10 + 0.02 * jitter[6], 0.8),
        0.02 + 0.06 * np.exp(-(w - 400) / 150) * (1 + 0.1 * jitter[7]),
        0.20 + 0.04 * (w - 400) / 2100 - 0.03 * _gaussian(w, 2300, 80),
    ]
    return np.clip(np.stack(spectra), 0.005, 1.0)


def _class_counts(
    num_pixels: int, num_classes: int, frequencies: Sequence[float] | None, fraction: float
) -> np.ndarray:
    weights = np.ones(num_classes) if frequencies is None else np.asarray(frequencies, dtype=np.float64)
    if weights.shape != (num_classes,) or np.any(weights < 0) or weights.sum() <= 0:
        raise DataError(f"class_frequencies must be {num_classes} non-negative numbers, not all 0; got {frequencies}.")
    if not 0 < fraction <= 1:
        raise DataError(f"labelled_fraction must be in (0, 1]; got {fraction}.")
    ideal = weights / weights.sum() * round(fraction * num_pixels)
    counts = np.floor(ideal).astype(np.int64)
    counts[np.argsort(counts - ideal)[: int(round(ideal.sum())) - counts.sum()]] += 1  # largest remainders
    return counts


def _fields(height: int, width: int, num_fields: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Voronoi cells with wobbly borders: cell index (H, W) and interiorness margin (H, W), larger = deeper inside."""
    rows, cols = np.mgrid[0:height, 0:width].astype(np.float64)
    wobble = 0.08 * np.sqrt(height * width / num_fields)
    rows = rows + wobble * np.sin(cols / 5.0 + rng.uniform(0, 6.3))
    cols = cols + wobble * np.sin(rows / 6.0 + rng.uniform(0, 6.3))
    seeds = rng.uniform((0, 0), (height, width), size=(num_fields, 2))
    distance, nearest = cKDTree(seeds).query(np.stack([rows.ravel(), cols.ravel()], axis=1), k=2)
    return nearest[:, 0].reshape(height, width), (distance[:, 1] - distance[:, 0]).reshape(height, width)


def _assign_fields(cell: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Give each class whole fields with room for its labelled pixels; return the owning class of each field."""
    num_fields = int(cell.max()) + 1
    area = np.bincount(cell.ravel(), minlength=num_fields)
    owner = np.zeros(num_fields, dtype=np.int64)  # 0 = field of unlabelled land cover
    free = list(rng.permutation(num_fields))
    for cls in np.argsort(-counts, kind="stable") + 1:
        need = counts[cls - 1] / 0.8  # fields are labelled to 80 % at most, leaving borders unlabelled
        while need > 0 and free:
            # The free field whose area best matches the remaining need keeps small classes in small fields.
            pick = min(free, key=lambda f: abs(area[f] - need))
            free.remove(pick)
            owner[pick] = cls
            need -= area[pick]
    capacity = np.bincount(owner, weights=area, minlength=counts.size + 1)[1:]
    short = np.flatnonzero(capacity < counts)
    if short.size:
        cls = int(short[0]) + 1
        raise DataError(
            f"Class {cls} needs {counts[cls - 1]} labelled pixels but its fields hold {int(capacity[cls - 1])}; lower "
            "labelled_fraction or use a larger image."
        )
    return owner


def make_synthetic_scene(
    height: int,
    width: int,
    bands: int,
    num_classes: int,
    class_frequencies: Sequence[float] | None = None,
    seed: int = 0,
    noise: float = 0.01,
    *,
    labelled_fraction: float = 0.5,
    wavelengths_nm: Sequence[float] | None = None,
    field_concentration: float = FIELD_CONCENTRATION,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate a labelled scene deterministically from `seed` (same seed, same arrays): (cube, gt, wavelengths_nm).

    The cube is (H, W, B) float32 reflectance, gt (H, W) int64 with classes 1..C and 0 unlabelled, wavelengths_nm (B,)
    float64; `scenes.load_scene` wraps them, with the class names, into a `Scene`.

    `class_frequencies` are relative class sizes (default equal); `labelled_fraction` of the pixels get labels, the
    rest stay 0. `noise` is the standard deviation of additive sensor noise in reflectance units. Wavelengths default to
    `bands` centres evenly spaced over 400-2500 nm. `field_concentration` sets how closely each field's mixture keeps
    to its class mean: lower makes the fields of one class differ more, and fields a model has not seen harder.
    """
    if min(height, width, bands, num_classes) < 1:
        raise DataError(f"Synthetic scene sizes must be >= 1; got {height}x{width}x{bands}, {num_classes} classes.")
    rng = np.random.default_rng(seed)
    wavelengths = np.linspace(400.0, 2500.0, bands) if wavelengths_nm is None else np.asarray(wavelengths_nm, float)
    if wavelengths.shape != (bands,):
        raise DataError(f"wavelengths_nm has {wavelengths.size} values for {bands} bands.")
    counts = _class_counts(height * width, num_classes, class_frequencies, labelled_fraction)
    num_fields = max(4 * num_classes, height * width // _PIXELS_PER_FIELD)
    cell, margin = _fields(height, width, num_fields, rng)
    owner = _assign_fields(cell, counts, rng)
    endmembers = endmember_spectra(wavelengths, rng)
    # Class means are sparse-ish mixtures; unlabelled land cover (owner 0) gets a mixture of its own.
    class_mixture = rng.dirichlet(np.full(endmembers.shape[0], 0.6), size=num_classes + 1)
    field_mixture = _dirichlet_around(class_mixture[owner], field_concentration, rng)
    pixel_mixture = _dirichlet_around(field_mixture[cell], _PIXEL_CONCENTRATION, rng)
    illumination = 1 + 0.05 * rng.standard_normal((height, width, 1))
    cube = (pixel_mixture @ endmembers) * illumination
    cube += noise * rng.standard_normal(cube.shape)
    gt = _label_interiors(cell, margin, owner, counts)
    return cube.astype(np.float32), gt, wavelengths


def _label_interiors(cell: np.ndarray, margin: np.ndarray, owner: np.ndarray, counts: np.ndarray) -> np.ndarray:
    gt = np.zeros(cell.shape, dtype=np.int64)
    flat_owner = owner[cell.ravel()]
    for cls in range(1, counts.size + 1):
        candidates = np.flatnonzero(flat_owner == cls)
        deepest = candidates[np.argsort(-margin.ravel()[candidates], kind="stable")[: counts[cls - 1]]]
        gt.ravel()[deepest] = cls
    return gt


def _dirichlet_around(mean: np.ndarray, concentration: float, rng: np.random.Generator) -> np.ndarray:
    """Draw one Dirichlet sample per row of `mean` (..., K) with that mean, vectorised through Gamma draws."""
    draws = rng.gamma(np.maximum(mean * concentration, 1e-3))
    return draws / draws.sum(axis=-1, keepdims=True)


def write_large_scene(
    cube_path: str | Path,
    labels_path: str | Path,
    shape: tuple[int, int, int],
    labelled_fraction: float = 0.02,
    seed: int = 0,
    num_classes: int = 8,
) -> None:
    """Write a (rows, cols, bands) float32 `.npy` cube and its int64 `.npy` label map, a block of rows at a time.

    For trying hslite on a flightline-sized cube of your own without one: a 200×200 synthetic scene is tiled over the
    image (its fields and spectra), fresh sensor noise is drawn per block, and `labelled_fraction` of the pixels keep
    their class. Memory holds one block (`make_synthetic_scene` builds whole float64 arrays, too much at this size).
    """
    rows, cols, bands = shape
    tile, tile_gt, _ = make_synthetic_scene(200, 200, bands, num_classes, seed=seed, labelled_fraction=0.5)
    rng = np.random.default_rng(seed + 1)
    keep = min(1.0, labelled_fraction / max(float(np.mean(tile_gt > 0)), 1e-9))
    cube = np.lib.format.open_memmap(cube_path, mode="w+", dtype=np.float32, shape=(rows, cols, bands))
    labels = np.zeros((rows, cols), dtype=np.int64)
    block_rows = max(1, 2**26 // (4 * cols * bands))  # 64 MiB of cube per block
    col_tiles = -(-cols // tile.shape[1])
    for start in range(0, rows, block_rows):
        stop = min(rows, start + block_rows)
        tile_rows = np.arange(start, stop) % tile.shape[0]
        block = np.tile(tile[tile_rows], (1, col_tiles, 1))[:, :cols]
        block += rng.standard_normal(block.shape, dtype=np.float32) * np.float32(0.01)
        cube[start:stop] = block
        gt = np.tile(tile_gt[tile_rows], (1, col_tiles))[:, :cols]
        labels[start:stop] = np.where(rng.random(gt.shape) < keep, gt, 0)
        cube.flush()
    del cube
    np.save(labels_path, labels)
