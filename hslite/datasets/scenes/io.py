"""Read scene files (.mat, ENVI, ERDAS, GeoTIFF, .npy); `geotiff_out` writes the maps.

Every failure a user can cause (missing, truncated or unexpected file) becomes a `DataError` that names the file and
says what to do. Cubes come back as (rows, cols, bands) float32 whatever the layout on disk, whole or (`CubeFile`) a
block of rows at a time. Fetching and verifying files is `fetch`'s job.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hslite.datasets.scenes.cube_file import BLOCK_BYTES, CubeFile, cube_from_array, npy_cube, released
from hslite.errors import DataError, unreadable

_TIFF_SUFFIXES = (".tif", ".tiff")
_SPECTRAL_SUFFIXES = (".gis", ".lan")  # ERDAS 7.4 files that spectral.open_image understands


# ----------------------------------------------------------------------------------------------------------- readers
def open_cube(path: str | Path, key: str | None = None, strict_key: bool = False) -> CubeFile:
    """Open a hyperspectral cube for reading by blocks of rows, with its CRS and affine transform (None if absent).

    `.mat` files use variable `key` when present, else the largest 3-D numeric array (`strict_key`: `key` or an
    error); they are read whole, as scipy allows nothing else. ENVI (`.hdr` or a data file with a `.hdr` beside it)
    and ERDAS (`.lan`, `.gis`) go through spectral, GeoTIFF through rasterio windows (bands-first on disk), `.npy`
    (rows, cols, bands) through a memory map.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".mat":
        return cube_from_array(_pick_mat_array(read_mat(path), path, key, 3, False, strict_key), str(path))
    if suffix in _TIFF_SUFFIXES:
        return _tiff_cube(path)
    if suffix == ".npy":
        return npy_cube(_load_npy(path, mmap=True), str(path))
    return _spectral_cube(path)


def read_cube(path: str | Path, key: str | None = None) -> tuple[np.ndarray, Any, Any]:
    """Read a whole cube as (rows, cols, bands) float32 with its CRS and transform; formats as in `open_cube`."""
    cube = open_cube(path, key)
    return cube.read(), cube.crs, cube.transform


def _tiff_cube(path: Path) -> CubeFile:
    import rasterio
    from rasterio.windows import Window

    with _open_raster(path) as dataset:
        shape = (dataset.height, dataset.width, dataset.count)
        dtype = np.dtype(dataset.dtypes[0])
        crs, transform = _georeference_of(dataset)

    def rows(start: int, stop: int) -> np.ndarray:
        # GDAL's block cache keeps what it read up to 5 % of the machine's memory: a second copy of a big cube
        with rasterio.Env(GDAL_CACHEMAX=BLOCK_BYTES), _open_raster(path) as dataset:  # reopened per block
            return np.moveaxis(dataset.read(window=Window(0, start, shape[1], stop - start)), 0, -1)

    return CubeFile(str(path), shape, dtype, crs, transform, None, rows, resident=False)


def _spectral_cube(path: Path) -> CubeFile:
    image = _open_spectral(path)
    shape = (int(image.nrows), int(image.ncols), int(image.nbands))
    scale = float(image.scale_factor)

    def read_rows(start: int, stop: int) -> np.ndarray:
        block = image.read_subregion((start, stop), (0, shape[1]))  # through spectral's memory map, when it has one
        # spectral's own load() divides by the header's reflectance scale factor: keep its values
        return block if scale == 1 else np.divide(block, scale, dtype=np.float32)

    centres = image.bands.centers
    wavelengths = None if not centres else wavelengths_to_nm(centres, image.bands.band_unit)
    crs, transform = georeference(Path(image.filename))  # GDAL reads an ENVI header's map info
    memmap = getattr(image, "_memmap", None)  # spectral's np.memmap of the file (None when it reads by seeks)
    rows = read_rows if memmap is None else released(read_rows, memmap)
    return CubeFile(str(path), shape, np.dtype(image.dtype), crs, transform, wavelengths, rows, resident=False)


def wavelengths_to_nm(values: Sequence[float] | np.ndarray, unit: str | None = None) -> np.ndarray:
    """Band centres in nm from values in `unit` (nm or µm); with no unit, values all below 100 are µm.

    ENVI headers often leave the unit out, and no imaging-spectrometer band lies below 100 nm.
    """
    centres = np.asarray(values, dtype=np.float64).ravel()
    unit = (unit or "").strip().lower()
    micro = unit.startswith(("micro", "um", "µm")) or (not unit and centres.size > 0 and centres.max() < 100)
    return centres * 1000.0 if micro else centres


def georeference(path: str | Path) -> tuple[Any, Any]:
    """CRS and affine transform of a raster GDAL reads (GeoTIFF, ENVI with map info), else (None, None)."""
    path = Path(path)
    if path.suffix.lower() in (".mat", ".npy") or not path.is_file():
        return None, None
    try:
        with _open_raster(path) as dataset:
            return _georeference_of(dataset)
    except DataError:
        return None, None


def read_labels(path: str | Path, key: str | None = None, strict_key: bool = False) -> np.ndarray:
    """Read a ground-truth map as a (rows, cols) int64 array of raw label codes (0 = unlabelled).

    `.mat` files use variable `key` when present, else the largest 2-D integer-valued array (`strict_key`: `key` or
    an error); ERDAS `.gis`/`.lan` and ENVI via spectral; GeoTIFF via rasterio (first band); `.npy` as is.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".mat":
        labels = _pick_mat_array(read_mat(path), path, key, 2, True, strict_key)
    elif suffix in _TIFF_SUFFIXES:
        with _open_raster(path) as dataset:
            labels = dataset.read(1)
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


def _pick_mat_array(
    variables: dict[str, Any], path: Path, key: str | None, ndim: int, integer: bool, strict_key: bool = False
) -> np.ndarray:
    arrays = {
        name: value
        for name, value in variables.items()
        if not name.startswith("__") and isinstance(value, np.ndarray) and value.dtype.kind in "biuf"
    }
    if key is not None and key in arrays and arrays[key].ndim == ndim:
        return arrays[key]
    if strict_key:
        seen = ", ".join(f"{name} {value.shape}" for name, value in arrays.items()) or "none"
        raise DataError(
            f"{path} has no {ndim}-D numeric variable {key!r} (numeric variables: {seen}); name one of them after "
            "the colon, as in FILE.mat:NAME."
        )
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


@contextmanager
def _open_raster(path: Path) -> Iterator[Any]:
    """rasterio.open that names the file on failure and is quiet about plain TIFFs without georeference."""
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioIOError

    _require_file(path)
    try:
        with warnings.catch_warnings():
            # Plain TIFFs (e.g. the Purdue label map) are expected here; having no georeference is not a fault.
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as dataset:
                yield dataset
    except RasterioIOError as err:
        raise DataError(f"{path} could not be read as a raster ({err}); it is probably truncated or corrupt.") from err


def _georeference_of(dataset: Any) -> tuple[Any, Any]:
    crs = dataset.crs
    return crs, dataset.transform if crs is not None or not dataset.transform.is_identity else None


def _load_npy(path: Path, mmap: bool = False) -> np.ndarray:
    _require_file(path)
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        why, cause = unreadable(err)
        raise DataError(
            f"{path} could not be read as a .npy array: {why}; it is truncated, or not numbers: save it as a plain "
            "numeric array (np.save of a float or integer array)."
        ) from cause


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
