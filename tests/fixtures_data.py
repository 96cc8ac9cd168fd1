"""Seeded generators of tiny scene files in every format hslite reads (used by the data tests).

Each writer produces the real on-disk format (variable names and dtypes as the public files use them) at a size that
keeps tests fast. Nothing here is downloaded.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import scipy.io

from hslite.datasets.scenes.registry import get_scene_spec

# dtypes of the public cubes (README of ../shared/data and the EHU files): used to write look-alike cubes.
REAL_CUBE_DTYPES = {"indian_pines": np.uint16, "pavia_university": np.uint16, "salinas": np.int16}


def tiny_cube(rows: int = 7, cols: int = 6, bands: int = 5, seed: int = 0, dtype=np.int16) -> np.ndarray:
    """A small integer-valued cube of radiance-like numbers."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, 9000, size=(rows, cols, bands)).astype(dtype)


def tiny_labels(rows: int = 7, cols: int = 6, num_classes: int = 3, seed: int = 0) -> np.ndarray:
    """A small uint8 label map with every class 1..C present and some 0 (unlabelled) pixels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes + 1, size=(rows, cols)).astype(np.uint8)
    labels.ravel()[: num_classes + 1] = np.arange(num_classes + 1)
    return labels


def write_mat(path: Path, compress: bool = True, **variables: np.ndarray) -> Path:
    """Write a MATLAB v5 file (compressed, as the EHU files are)."""
    scipy.io.savemat(path, variables, do_compression=compress)
    return path


def write_real_format_cube(folder: Path, scene: str, seed: int = 0) -> Path:
    """Write a random cube with the real file name, variable name, dtype and full shape of `scene`."""
    spec = get_scene_spec(scene)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cube = rng.integers(0, 8000, size=spec.shape, dtype=np.int16).astype(REAL_CUBE_DTYPES[scene])
    return write_mat(folder / spec.cube_file.name, compress=False, **{spec.cube_key: cube})


def write_envi(path_hdr: Path, cube: np.ndarray, wavelengths_nm=None) -> Path:
    """Write an ENVI header + BSQ raw file with spectral (as ENVI exports it)."""
    import spectral.io.envi as envi

    metadata = {} if wavelengths_nm is None else {"wavelength": [f"{w:.2f}" for w in wavelengths_nm]}
    envi.save_image(str(path_hdr), cube, dtype=cube.dtype, interleave="bsq", metadata=metadata, force=True)
    return path_hdr


def write_geotiff_cube(path: Path, cube: np.ndarray, epsg: int = 32615) -> tuple[object, object]:
    """Write a (rows, cols, bands) cube as a bands-first GeoTIFF with a UTM CRS; return (crs, transform)."""
    import rasterio
    from affine import Affine
    from rasterio.crs import CRS

    crs, transform = CRS.from_epsg(epsg), Affine(2.5, 0.0, 271460.0, 0.0, -2.5, 3290891.0)  # 2.5 m UTM pixels
    profile = dict(driver="GTiff", height=cube.shape[0], width=cube.shape[1], count=cube.shape[2],
                   dtype=cube.dtype.name, crs=crs, transform=transform)  # fmt: skip
    with rasterio.open(path, "w", **profile) as dataset:
        dataset.write(np.moveaxis(cube, -1, 0))
    return crs, transform


def write_erdas_gis(path: Path, labels: np.ndarray) -> Path:
    """Write an ERDAS 7.4 .GIS class map: 128-byte "HEAD74" header, then uint8 labels (as 92AV3GT.GIS)."""
    rows, cols = labels.shape
    header = b"HEAD74" + struct.pack("<hh", 0, 1) + b"\0" * 6 + struct.pack("<iiii", cols, rows, 0, 0)
    path.write_bytes(header.ljust(128, b"\0") + labels.astype(np.uint8).tobytes())
    return path


def write_v73_mat(path: Path) -> Path:
    """Write the header of a MATLAB v7.3 file (HDF5 inside), enough for readers to recognise it."""
    text = b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: Mon Jan  1 00:00:00 2024 HDF5 schema 1.00 ."
    header = text.ljust(116, b" ") + b"\0" * 8 + b"\x00\x02" + b"IM"
    path.write_bytes(header.ljust(512, b"\0") + b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    return path


def truncate(path: Path, keep_fraction: float = 0.5) -> Path:
    """Cut a file to a fraction of its bytes, as an interrupted download would."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    return path
