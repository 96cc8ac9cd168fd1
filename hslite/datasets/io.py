"""Read scene files (.mat, ENVI, ERDAS, GeoTIFF, .npy) and write label GeoTIFFs.

Every failure a user can cause (missing, truncated or unexpected file) becomes a `DataError` that names the file and
says what to do. Cubes come back as (rows, cols, bands) float32 whatever the layout on disk. Fetching and verifying
files is `fetch`'s job.
"""

from __future__ import annotations

import os
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from hslite.errors import DataError

_TIFF_SUFFIXES = (".tif", ".tiff")
_SPECTRAL_SUFFIXES = (".gis", ".lan")  # ERDAS 7.4 files that spectral.open_image understands


# ----------------------------------------------------------------------------------------------------------- readers
def read_cube(path: str | Path, key: str | None = None) -> tuple[np.ndarray, Any, Any]:
    """Read a hyperspectral cube as (rows, cols, bands) float32, with its CRS and affine transform (None if absent).

    `.mat` files use variable `key` when present, else the largest 3-D numeric array. ENVI (`.hdr` or a data file with
    a `.hdr` beside it) and ERDAS (`.lan`, `.gis`) go through spectral; GeoTIFF through rasterio (bands-first on disk);
    `.npy` is taken as (rows, cols, bands).
    """
    path = Path(path)
    crs = transform = None
    suffix = path.suffix.lower()
    if suffix == ".mat":
        cube = _pick_mat_array(read_mat(path), path, key, ndim=3, integer=False)
    elif suffix in _TIFF_SUFFIXES:
        bands_first, crs, transform = _read_tiff(path)
        cube = np.moveaxis(bands_first, 0, -1)
    elif suffix == ".npy":
        cube = _load_npy(path)
    else:
        cube = np.asarray(_open_spectral(path).load())
    if cube.ndim == 2:
        cube = cube[:, :, None]
    if cube.ndim != 3:
        raise DataError(f"{path} holds an array of shape {cube.shape}; a cube must be (rows, cols, bands).")
    return np.ascontiguousarray(cube, dtype=np.float32), crs, transform


def read_labels(path: str | Path, key: str | None = None) -> np.ndarray:
    """Read a ground-truth map as a (rows, cols) int64 array of raw label codes (0 = unlabelled).

    `.mat` files use variable `key` when present, else the largest 2-D integer-valued array; ERDAS `.gis`/`.lan` and
    ENVI via spectral; GeoTIFF via rasterio (first band); `.npy` as is.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".mat":
        labels = _pick_mat_array(read_mat(path), path, key, ndim=2, integer=True)
    elif suffix in _TIFF_SUFFIXES:
        labels = _read_tiff(path)[0][0]
    elif suffix == ".npy":
        labels = _load_npy(path)
    else:
        labels = np.asarray(_open_spectral(path).read_band(0))
        if labels.dtype == np.int8:
            labels = labels.view(np.uint8)  # ERDAS GIS classes are unsigned bytes; spectral reports them as int8
    if labels.ndim == 3 and labels.shape[2] == 1:
        labels = labels[:, :, 0]
    if labels.ndim != 2 or not _is_integer_valued(labels):
        raise DataError(
            f"{path} holds {labels.dtype} data of shape {labels.shape}; a label map must be a 2-D array of integer "
            "class codes. Check that this is the ground-truth file and not the cube."
        )
    return labels.astype(np.int64)


def read_mat(path: str | Path) -> dict[str, Any]:
    """Load a MATLAB v4/v5 file with scipy; v7.3 (HDF5), truncated or corrupt files raise a DataError saying why."""
    import scipy.io

    path = Path(path)

    _require_file(path)
    with open(path, "rb") as f:
        header = f.read(128)
    # A v7.3 file is HDF5 behind a MATLAB text header: version word 0x0200 at byte 124.
    if header.startswith(b"MATLAB 7.3") or header[124:126] in (b"\x00\x02", b"\x02\x00"):
        raise DataError(
            f"{path} is a MATLAB v7.3 (HDF5) file, which scipy cannot read. Install h5py and convert it, or re-save "
            "it from MATLAB as v5 with save(name, '-v7') (or Octave's save -mat7-binary)."
        )
    try:
        return scipy.io.loadmat(path)
    except (ValueError, OSError, IndexError, TypeError, EOFError, zlib.error, NotImplementedError) as err:
        raise DataError(
            f"{path} could not be read as a MATLAB file ({type(err).__name__}: {err}); it is probably truncated or "
            "corrupt. Delete it and download it again."
        ) from err


def _pick_mat_array(variables: dict[str, Any], path: Path, key: str | None, ndim: int, integer: bool) -> np.ndarray:
    arrays = {
        name: value
        for name, value in variables.items()
        if not name.startswith("__") and isinstance(value, np.ndarray) and value.dtype.kind in "biuf"
    }
    if key is not None and key in arrays and arrays[key].ndim == ndim:
        return arrays[key]
    candidates = [
        (value.size, name)
        for name, value in arrays.items()
        if value.ndim == ndim and (not integer or _is_integer_valued(value))
    ]
    if not candidates:
        seen = ", ".join(f"{name} {value.shape} {value.dtype}" for name, value in arrays.items()) or "none"
        kind = "integer label map" if integer else "cube"
        raise DataError(
            f"{path} has no {ndim}-D numeric array to use as the {kind} (expected variable {key!r}; numeric "
            f"variables seen: {seen}). Check that this is the right file for the scene."
        )
    return arrays[max(candidates)[1]]


def _is_integer_valued(array: np.ndarray) -> bool:
    if array.dtype.kind in "biu":
        return True
    return array.dtype.kind == "f" and bool(np.all(np.isfinite(array))) and bool(np.all(array == np.round(array)))


def _read_tiff(path: Path) -> tuple[np.ndarray, Any, Any]:
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioIOError

    _require_file(path)
    try:
        with warnings.catch_warnings():
            # Plain TIFFs (e.g. the Purdue label map) are expected here; having no georeference is not a fault.
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as dataset:
                data = dataset.read()
                crs = dataset.crs
                transform = dataset.transform if crs is not None or not dataset.transform.is_identity else None
    except RasterioIOError as err:
        raise DataError(f"{path} could not be read as a TIFF ({err}); it is probably truncated or corrupt.") from err
    return data, crs, transform


def _load_npy(path: Path) -> np.ndarray:
    _require_file(path)
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise DataError(f"{path} could not be read as a .npy array ({err}); it is probably truncated.") from err


def _open_spectral(path: Path) -> Any:
    import spectral
    from spectral.utilities.errors import SpyException

    headers = [h for h in (path.with_suffix(".hdr"), Path(f"{path}.hdr")) if h.exists()]
    if path.suffix.lower() in (*_SPECTRAL_SUFFIXES, ".hdr"):
        target, data_file = path, None
    elif headers:
        target, data_file = headers[0], path  # an ENVI data file named directly, its header beside it
    else:
        raise DataError(
            f"{path} has an unknown format (suffix {path.suffix!r}). hslite reads .mat, .tif/.tiff, .npy, ENVI "
            "(.hdr beside the data file) and ERDAS .lan/.gis."
        )
    _require_file(target)
    try:
        if data_file is not None:
            return spectral.envi.open(str(target), str(data_file))
        return spectral.open_image(str(target))
    except (SpyException, OSError, ValueError) as err:
        raise DataError(
            f"{target} could not be opened by spectral ({err}); it is probably truncated or corrupt."
        ) from err


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"{path} does not exist. Put the file there, or point data.root at the folder that holds it.")


# ----------------------------------------------------------------------------------------------------------- writers
def write_geotiff(path: str | Path, labels: np.ndarray, crs: Any, transform: Any) -> None:
    """Write a (rows, cols) integer label map as a single-band GeoTIFF, atomically (temp file + rename).

    `crs` and `transform` may be None for scenes without georeference; the file is then a plain TIFF.
    """
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    labels = np.asarray(labels)
    if labels.ndim != 2 or labels.dtype.kind not in "biu":
        raise DataError(f"write_geotiff needs a 2-D integer label map; got {labels.dtype} of shape {labels.shape}.")
    low, high = (int(labels.min()), int(labels.max())) if labels.size else (0, 0)
    dtype = next(
        t for t in (np.uint8, np.int16, np.int32, np.int64) if np.iinfo(t).min <= low and high <= np.iinfo(t).max
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tif")
    os.close(handle)
    profile = {
        "driver": "GTiff",
        "height": labels.shape[0],
        "width": labels.shape[1],
        "count": 1,
        "dtype": np.dtype(dtype).name,
        "crs": crs,
        "transform": transform,
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)  # scenes without georeference are expected
            with rasterio.open(tmp_name, "w", **profile) as dataset:
                dataset.write(labels.astype(dtype), 1)
        os.replace(tmp_name, path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
