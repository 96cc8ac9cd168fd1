"""Write label maps and per-class rasters as GeoTIFFs: whole, or a block of rows at a time, renamed into place whole.

A crash mid-write leaves the previous file (or none) under the name, never half a raster.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hslite.atomic import file_mode
from hslite.errors import DataError


def write_geotiff(path: str | Path, labels: np.ndarray, crs: Any, transform: Any) -> None:
    """Write a (rows, cols) integer label map as a single-band GeoTIFF, atomically (temp file + rename).

    `crs` and `transform` may be None for scenes without georeference; the file is then a plain TIFF.
    """
    labels = np.asarray(labels)
    if labels.ndim != 2 or labels.dtype.kind not in "biu":
        raise DataError(f"write_geotiff needs a 2-D integer label map; got {labels.dtype} of shape {labels.shape}.")
    low, high = (int(labels.min()), int(labels.max())) if labels.size else (0, 0)
    dtype = next(
        t for t in (np.uint8, np.int16, np.int32, np.int64) if np.iinfo(t).min <= low and high <= np.iinfo(t).max
    )
    with geotiff_writer(path, labels.shape, 1, dtype, crs, transform) as dataset:
        dataset.write(labels.astype(dtype), 1)


@contextmanager
def geotiff_writer(
    path: str | Path, shape: tuple[int, int], count: int, dtype: Any, crs: Any, transform: Any
) -> Iterator[Any]:
    """An open rasterio dataset of `count` bands for a new GeoTIFF, renamed over `path` only if the block succeeds.

    Blocks of rows can be written into it one at a time (`dataset.write(data, window=...)`); `crs` and `transform`
    None make a plain TIFF.
    """
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tif")
    os.fchmod(handle, file_mode())  # GDAL writes into the file mkstemp made 0600
    os.close(handle)
    profile = {
        "driver": "GTiff",
        "height": shape[0],
        "width": shape[1],
        "count": count,
        "dtype": np.dtype(dtype).name,
        "crs": crs,
        "transform": transform,
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)  # scenes without georeference are expected
            with rasterio.open(tmp_name, "w", **profile) as dataset:
                yield dataset
        os.replace(tmp_name, path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
