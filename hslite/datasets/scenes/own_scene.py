"""Your own scene: a cube file and its label raster named by path (`data.scene=PATH data.labels=PATH`).

A scene string is a path when it has a file suffix or a path separator; anything else is a registered name. A
`.mat` variable is chosen as `FILE.mat:NAME`; without a name the largest 3-D array is the cube and the largest 2-D
integer-valued array the label map. Label codes other than `ignore_label` become classes 1..C in ascending code
order, and the codes are kept (`Scene.label_codes`) so that outputs are written in the label file's own codes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hslite.datasets.scenes.io import CubeFile, georeference, open_cube, read_labels, wavelengths_to_nm
from hslite.datasets.scenes.registry import Scene, get_scene_spec
from hslite.errors import ConfigError, DataError, unreadable

MAX_CLASSES = 255  # more distinct codes than this is a cube or a continuous raster given as the label map


def is_scene_path(scene: str) -> bool:
    """Whether `data.scene` names a file (it has a suffix or a path separator) rather than a registered scene."""
    return bool(Path(scene).suffix) or "/" in scene or os.sep in scene


def split_key(spec: str) -> tuple[Path, str | None]:
    """`FILE.mat:NAME` -> (FILE.mat, NAME); any other path -> (path, None)."""
    head, colon, key = spec.rpartition(":")
    if colon and key and head.lower().endswith(".mat"):
        return Path(head).expanduser(), key
    return Path(spec).expanduser(), None


def _existing(spec: str, option: str) -> str:
    """`spec` with its path made absolute (a spawned rank or a later `hslite predict` may run elsewhere)."""
    path, key = split_key(spec)
    if not path.is_file():
        raise DataError(
            f"{path} ({option}) does not exist. Check the path; a relative one is read from the folder hslite runs in "
            f"({Path.cwd()})."
        )
    return f"{path.resolve()}:{key}" if key else str(path.resolve())


def open_cube_spec(spec: str, option: str = "cube") -> CubeFile:
    """Open the cube `PATH` or `FILE.mat:NAME` names (a named variable must exist)."""
    path, key = split_key(_existing(spec, option))
    return open_cube(path, key, strict_key=key is not None)


@dataclass(frozen=True)
class OwnScene:
    """Where a user's scene lives and how its labels read; `load()` reads and checks it like a registered scene."""

    cube: str  # absolute path of the cube file, FILE.mat:NAME for a .mat variable
    labels: str  # absolute path of the label raster (GeoTIFF, .mat, .npy, ENVI, ERDAS .gis)
    wavelengths: str | None = None  # text or .npy file of band centres, nm; None: the cube header's, if any
    class_names: tuple[str, ...] = ()  # one per class, in ascending code order; () means "class <code>"
    ignore_label: int = 0  # code of unlabelled pixels

    @classmethod
    def from_paths(
        cls,
        cube: str,
        labels: str | None,
        wavelengths: str | None = None,
        class_names: tuple[str, ...] | list[str] = (),
        ignore_label: int = 0,
    ) -> OwnScene:
        """Check that the files exist and make their paths absolute; the contents are read by `load`."""
        if not labels:
            raise ConfigError(
                f"data.scene={cube} is a cube of your own: give its label raster with data.labels=PATH (code "
                "data.ignore_label, 0 by default, marks unlabelled pixels)."
            )
        return cls(
            _existing(cube, "data.scene"),
            _existing(labels, "data.labels"),
            None if wavelengths is None else _existing(wavelengths, "data.wavelengths"),
            tuple(class_names),
            int(ignore_label),
        )

    def load(self) -> Scene:
        """The scene with classes 1..C (0 unlabelled), georeferenced by the cube or else by the label raster.

        The cube is opened, not read: `Scene.source` reads it a block of rows at a time.
        """
        cube = open_cube_spec(self.cube, "data.scene")
        labels_path, labels_key = split_key(self.labels)
        raw = read_labels(labels_path, labels_key, strict_key=labels_key is not None)
        if raw.shape != cube.shape[:2]:
            raise DataError(
                f"{labels_path} is a {raw.shape} label map but the cube {cube.source} is {cube.shape[:2]} (rows, "
                "cols); they must cover the same pixels."
            )
        gt, codes = _classes_from_codes(raw, self.ignore_label, labels_path)
        if self.class_names and len(self.class_names) != len(codes):
            raise DataError(
                f"data.class_names has {len(self.class_names)} names but {labels_path} has {len(codes)} classes "
                f"(codes {codes}); give one name per code, in ascending code order."
            )
        names = list(self.class_names) or [f"class {code}" for code in codes]
        wavelengths = cube.wavelengths_nm if self.wavelengths is None else read_wavelengths(Path(self.wavelengths))
        if wavelengths is not None and wavelengths.size != cube.shape[2]:
            raise DataError(
                f"{self.wavelengths or cube.source} gives {wavelengths.size} band centres but the cube has "
                f"{cube.shape[2]} bands; give one wavelength per band."
            )
        crs, transform = cube.crs, cube.transform
        if crs is None and transform is None:
            crs, transform = georeference(labels_path)
        return Scene(Path(cube.source).stem, cube, gt, names, wavelengths, crs, transform, codes)


def own_scene_for(
    scene: str, labels: str | None, wavelengths: str | None, class_names: list[str] | tuple[str, ...], ignore_label: int
) -> OwnScene | None:
    """The OwnScene `scene` names by path, its files checked; None for a registered name (which must exist)."""
    if is_scene_path(scene):
        return OwnScene.from_paths(scene, labels, wavelengths, class_names, ignore_label)
    get_scene_spec(scene)
    if labels or wavelengths or class_names or ignore_label:
        raise ConfigError(
            "data.labels, data.wavelengths, data.class_names and data.ignore_label describe a cube of your own "
            f"(data.scene=PATH); {scene} is a registered scene that brings its own. Drop them, or name your file."
        )
    return None


def _classes_from_codes(raw: np.ndarray, ignore_label: int, path: Path) -> tuple[np.ndarray, tuple[int, ...]]:
    codes = np.unique(raw)
    codes = codes[codes != ignore_label]
    if codes.size < 2:
        raise DataError(
            f"{path} has {codes.size} class code(s) besides the unlabelled {ignore_label} (data.ignore_label); a "
            "classifier needs at least 2. Check the label file and data.ignore_label."
        )
    if codes.size > MAX_CLASSES:
        raise DataError(
            f"{path} has {codes.size} distinct label codes, more than the {MAX_CLASSES} a label map may hold; check "
            "that it is the label raster and not the cube."
        )
    gt = np.searchsorted(codes, raw) + 1
    gt[raw == ignore_label] = 0
    return gt, tuple(int(code) for code in codes)


def read_wavelengths(path: Path) -> np.ndarray:
    """Band centres, nm (values all below 100 are taken as µm), from a .npy array or a text file of numbers."""
    try:
        if path.suffix.lower() == ".npy":
            values = np.load(path, allow_pickle=False)
        else:
            values = np.array(path.read_text().replace(",", " ").split(), dtype=np.float64)
        return wavelengths_to_nm(values)
    except (ValueError, OSError) as err:
        why, cause = unreadable(err)
        raise DataError(
            f"{path} could not be read as band centres: {why}; give a numeric .npy array or a text file of numbers, "
            "one per band, in nm."
        ) from cause


def describe_file(spec: str) -> list[str]:
    """Lines that `hslite data info PATH` prints: shape, type, bands, wavelengths, georeference, label counts."""
    path, key = split_key(_existing(spec, "data info"))
    try:
        cube = open_cube(path, key, strict_key=key is not None)
    except DataError:
        cube = None  # e.g. a .mat holding a label map only: read it as labels below, whose error names the file
    if cube is None or (cube.shape[2] == 1 and cube.dtype.kind in "biu"):
        labels = read_labels(path, key, strict_key=key is not None)
        codes, counts = np.unique(labels, return_counts=True)
        crs, _ = georeference(path)
        return [
            f"{path}: label map, {labels.shape[0]}×{labels.shape[1]} pixels, {codes.size} codes",
            f"  georeference: {crs or 'none'}",
            "  pixels per code: " + ", ".join(f"{code}: {count}" for code, count in zip(codes, counts, strict=True)),
        ]
    rows, cols, bands = cube.shape
    lines = [f"{path}: cube, {rows}×{cols} pixels, {bands} bands, {cube.dtype} on disk"]
    w = cube.wavelengths_nm
    lines.append(
        f"  wavelengths: {w.min():.1f}–{w.max():.1f} nm" if w is not None else "  wavelengths: none in the file"
    )
    transform = "" if cube.transform is None else f", transform {tuple(cube.transform)[:6]}"
    lines.append(f"  georeference: {cube.crs or 'none'}{transform}")
    return lines
