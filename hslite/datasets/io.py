"""Read scene files (.mat, ENVI, ERDAS, GeoTIFF, .npy), fetch and verify them, and write label GeoTIFFs.

Every failure a user can cause (missing, truncated or unexpected file) becomes a `DataError` that names the file and
says what to do. Cubes come back as (rows, cols, bands) float32 whatever the layout on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import urllib.error
import urllib.request
import warnings
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hslite.errors import DataError

if TYPE_CHECKING:
    from hslite.datasets.scenes import RemoteFile

log = logging.getLogger(__name__)

_TIFF_SUFFIXES = (".tif", ".tiff")
_SPECTRAL_SUFFIXES = (".gis", ".lan")  # ERDAS 7.4 files that spectral.open_image understands
_HASH_CHUNK_BYTES = 1 << 20
_DOWNLOAD_TIMEOUT_SECONDS = 60


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


# ------------------------------------------------------------------------------------------------- fetch and verify
def ensure_file(remote: RemoteFile, folder: Path, download: bool) -> Path:
    """Return the path of `remote` inside `folder`, downloading it when missing and allowed; verify its sha256.

    A verified checksum is cached in `<file>.sha256` keyed on size and mtime, so big files are hashed once. Downloads
    go to a temporary file in the same folder and are moved into place only after they verify (atomic).
    """
    folder = Path(folder)
    path = folder / remote.name
    if path.is_file():
        _verify(path, remote)
        return path
    where = f"put it at {path}, or point data.root at a folder that holds {folder.name}/{remote.name}"
    if remote.url is None:
        raise DataError(
            f"{remote.name} is missing and has no public download URL; obtain it as described in data/README.md and "
            f"{where}."
        )
    if not download:
        raise DataError(
            f"{remote.name} is missing. Download it from {remote.url} and {where}; or set data.download=true "
            "(download=True) to fetch it automatically."
        )
    _download(remote, path)
    return path


def _verify(path: Path, remote: RemoteFile) -> None:
    size_bytes = path.stat().st_size
    fix = f"Delete it and download it again from {remote.url}" if remote.url else "Replace it with a good copy"
    if remote.size_bytes is not None and size_bytes != remote.size_bytes:
        raise DataError(
            f"{path} is {size_bytes} bytes but {remote.name} should be {remote.size_bytes} bytes; it is truncated or "
            f"a different file. {fix}."
        )
    if remote.sha256 is None:
        return
    digest = _cached_sha256(path) or _hash_and_cache(path)
    if digest != remote.sha256:
        raise DataError(
            f"{path} has sha256 {digest} but {remote.name} should have {remote.sha256}; the file is corrupt or a "
            f"different version. {fix}."
        )


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _cached_sha256(path: Path) -> str | None:
    try:
        cached = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return None
    stat = path.stat()
    if (
        isinstance(cached, dict)
        and cached.get("size_bytes") == stat.st_size
        and cached.get("mtime_ns") == stat.st_mtime_ns
    ):
        return cached.get("sha256")
    return None


def _hash_and_cache(path: Path, digest: str | None = None) -> str:
    digest = digest or sha256_file(path)
    stat = path.stat()
    record = {"sha256": digest, "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        _sidecar(path).write_text(json.dumps(record))
    except OSError:
        log.debug("cannot cache the checksum of %s (read-only folder?); it will be hashed again next time", path)
    return digest


def sha256_file(path: Path) -> str:
    """Return the hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _download(remote: RemoteFile, path: Path) -> None:
    assert remote.url is not None  # ensure_file only downloads files that have a URL
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{remote.name}.", suffix=".part")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    log.info("downloading %s to %s", remote.url, path)
    try:
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(remote.url, timeout=_DOWNLOAD_TIMEOUT_SECONDS) as r:
            while chunk := r.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
        size_bytes = tmp.stat().st_size
        if remote.size_bytes is not None and size_bytes != remote.size_bytes:
            raise DataError(
                f"Downloading {remote.url} gave {size_bytes} bytes, not the {remote.size_bytes} expected for "
                f"{remote.name}; nothing was saved. Try again, or download it by hand to {path}."
            )
        if remote.sha256 is not None and digest.hexdigest() != remote.sha256:
            raise DataError(
                f"Downloading {remote.url} gave sha256 {digest.hexdigest()}, not the {remote.sha256} expected for "
                f"{remote.name}; nothing was saved. The server may serve a different version: download it by hand, "
                f"check it, and put it at {path}."
            )
        os.replace(tmp, path)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise DataError(
            f"Could not download {remote.name} from {remote.url} ({err}). If this machine is offline, download it "
            f"elsewhere and put it at {path}."
        ) from err
    finally:
        tmp.unlink(missing_ok=True)
    if remote.sha256 is not None:
        _hash_and_cache(path, digest.hexdigest())


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
