"""Registry of known scenes (files, shapes, classes, bands) and `load_scene`, which turns one into a `Scene`.

Files live at `<root>/<scene folder>/<original file name>`, the layout of ../shared/data; sources and checksums are
those listed in ../shared/data/README.md (None where no trustworthy digest is known).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hslite.datasets.io import ensure_file, read_cube, read_labels, read_mat
from hslite.datasets.preprocess import check_labels
from hslite.datasets.wavelengths import INDIAN_PINES_220_NM
from hslite.errors import DataError


@dataclass(frozen=True)
class RemoteFile:
    """One file of a scene as distributed: its original name, download URL (None = local only) and digest."""

    name: str
    url: str | None
    sha256: str | None
    size_bytes: int | None


@dataclass(frozen=True)
class SceneSpec:
    """What hslite knows about a scene before reading it: files, shape as distributed, classes and bands."""

    name: str
    title: str
    sensor: str
    shape: tuple[int, int, int]  # rows, cols, bands of the cube as distributed
    cube_file: RemoteFile
    gt_file: RemoteFile
    cube_key: str | None  # .mat variable name; readers still search when it is absent
    gt_key: str | None
    class_names: tuple[str, ...]
    label_values: tuple[int, ...] | None  # raw gt codes of classes 1..C in order; None = codes are already 1..C
    wavelengths_nm: tuple[float, ...] | None
    water_bands: tuple[int, ...] = ()  # 0-based bands conventionally removed
    description: str = ""


# ------------------------------------------------------------------------------------------------------ reference
_EHU = "https://www.ehu.eus/ccwintco/uploads/"
_MIRROR = "https://raw.githubusercontent.com/ricardoborsoi/MUA_SparseUnmixing/master/real_data/"
_GENERATED = RemoteFile(name="(generated from the seed)", url=None, sha256=None, size_bytes=None)

INDIAN_PINES_CLASSES = (
    "Alfalfa", "Corn-notill", "Corn-mintill", "Corn", "Grass-pasture", "Grass-trees", "Grass-pasture-mowed",
    "Hay-windrowed", "Oats", "Soybean-notill", "Soybean-mintill", "Soybean-clean", "Wheat", "Woods",
    "Buildings-Grass-Trees-Drives", "Stone-Steel-Towers",
)  # fmt: skip
# Labelled pixels per class of the EHU Indian_pines_gt.mat (10249 in all).
INDIAN_PINES_CLASS_COUNTS = (46, 1428, 830, 237, 483, 730, 28, 478, 20, 972, 2455, 593, 205, 1265, 386, 93)
# 1-based 104-108, 150-163 and 220 of the 220-band cube (water absorption), counted from 0.
INDIAN_PINES_WATER_BANDS = (*range(103, 108), *range(149, 163), 219)
_IP_KEPT = tuple(i for i in range(220) if i not in INDIAN_PINES_WATER_BANDS)
INDIAN_PINES_200_NM = tuple(INDIAN_PINES_220_NM[i] for i in _IP_KEPT)

SALINAS_CLASSES = (
    "Brocoli_green_weeds_1", "Brocoli_green_weeds_2", "Fallow", "Fallow_rough_plow", "Fallow_smooth", "Stubble",
    "Celery", "Grapes_untrained", "Soil_vinyard_develop", "Corn_senesced_green_weeds", "Lettuce_romaine_4wk",
    "Lettuce_romaine_5wk", "Lettuce_romaine_6wk", "Lettuce_romaine_7wk", "Vinyard_untrained",
    "Vinyard_vertical_trellis",
)  # fmt: skip
_SALINAS_A_CODES = (1, 10, 11, 12, 13, 14)

_SPECS = (
    SceneSpec(
        "indian_pines", "Indian Pines (200 bands)", "AVIRIS", (145, 145, 200),
        RemoteFile("Indian_pines_corrected.mat", _EHU + "6/67/Indian_pines_corrected.mat",
                   "ec2f8808710919d566f70f0d4aa885aae1ddfd42b734aba71c5e12ca65450939", 5953527),
        RemoteFile("Indian_pines_gt.mat", _EHU + "c/c4/Indian_pines_gt.mat",
                   "65c4687a8ab04f6da4789799bc3bc4f6e88bccac3ed6a2e6ae367e5e6b9e429c", 1125),
        "indian_pines_corrected", "indian_pines_gt", INDIAN_PINES_CLASSES, None, INDIAN_PINES_200_NM,
        description="EHU cube with the 20 water-absorption bands already removed.",
    ),
    SceneSpec(
        "indian_pines_raw", "Indian Pines (220 bands)", "AVIRIS", (145, 145, 220),
        RemoteFile("Indian_pines.mat", _EHU + "2/22/Indian_pines.mat", None, None),
        RemoteFile("Indian_pines_gt.mat", _EHU + "c/c4/Indian_pines_gt.mat",
                   "65c4687a8ab04f6da4789799bc3bc4f6e88bccac3ed6a2e6ae367e5e6b9e429c", 1125),
        "indian_pines", "indian_pines_gt", INDIAN_PINES_CLASSES, None, INDIAN_PINES_220_NM,
        water_bands=INDIAN_PINES_WATER_BANDS,
        description="All 220 AVIRIS bands; shares the indian_pines folder and ground truth.",
    ),
    SceneSpec(
        "pavia_university", "Pavia University", "ROSIS (430-860 nm)", (610, 340, 103),
        RemoteFile("PaviaU.mat", _EHU + "e/ee/PaviaU.mat",
                   "28447fa87f7a5797845e9a189c0da85e23b1d06a4ba7361e5ff44efbf834d2fb", 34806917),
        RemoteFile("PaviaU_gt.mat", _EHU + "5/50/PaviaU_gt.mat",
                   "23f6a426928f9b32984adffe659e29f554f9fb6c93b5a107528d308d5087a829", 11005),
        "paviaU", "paviaU_gt",
        ("Asphalt", "Meadows", "Gravel", "Trees", "Painted metal sheets", "Bare Soil", "Bitumen",
         "Self-Blocking Bricks", "Shadows"),
        None, None,  # the file carries no band centres; 103 of ROSIS's 115 bands over 430-860 nm
        description="ROSIS over Pavia, 1.3 m pixels; 12 noisy bands already removed.",
    ),
    SceneSpec(
        "salinas", "Salinas", "AVIRIS", (512, 217, 204),
        RemoteFile("Salinas_corrected.mat", _EHU + "a/a3/Salinas_corrected.mat",
                   "5ec1c0d22f56d18ecd336f8e35735863c0f160682e04e0c18ef3f89a3334d87d", 26552770),
        RemoteFile("Salinas_gt.mat", _EHU + "f/fa/Salinas_gt.mat",
                   "ecfab4d31ef5553f097943235d8ea502038eb4a2067b2ad10b33e37c949955e2", 4277),
        "salinas_corrected", "salinas_gt", SALINAS_CLASSES, None, None,
        description="Bands 108-112, 154-167 and 224 (1-based, of 224) already removed.",
    ),
    SceneSpec(
        "salinas_a", "Salinas-A", "AVIRIS", (83, 86, 204),
        RemoteFile("SalinasA_corrected.mat", _EHU + "1/1a/SalinasA_corrected.mat",
                   "d75684ed3ab71a1024cee0f9db9061f50a3523a92ff5edfbbb1eed976b9f1721", 1539086),
        RemoteFile("SalinasA_gt.mat", _EHU + "a/aa/SalinasA_gt.mat",
                   "17814c1d3296c0e29b27f320f2c4174d2a68adb87e376abe78f02923e2c2e454", 587),
        "salinasA_corrected", "salinasA_gt", tuple(SALINAS_CLASSES[c - 1] for c in _SALINAS_A_CODES),
        _SALINAS_A_CODES, None,
        description="Subscene of Salinas; labels keep the full-Salinas codes 1, 10-14.",
    ),
    SceneSpec(
        "ksc", "Kennedy Space Center", "AVIRIS", (512, 614, 176),
        RemoteFile("KSC.mat", _EHU + "2/26/KSC.mat",
                   "b1ad011cfdb65c853e4f9f6108ca4774467d87f90a5c23b74ff3a2984a3b4786", 56824624),
        # The gt digest is attested by a single source only, so it is not enforced.
        RemoteFile("KSC_gt.mat", _EHU + "a/a6/KSC_gt.mat", None, None),
        "KSC", "KSC_gt",
        ("Scrub", "Willow swamp", "CP hammock", "Slash pine", "Oak/Broadleaf", "Hardwood", "Swamp",
         "Graminoid marsh", "Spartina marsh", "Cattail marsh", "Salt marsh", "Mud flats", "Water"),
        None, None,
    ),
    SceneSpec(
        "botswana", "Botswana (Okavango Delta)", "Hyperion", (1476, 256, 145),
        RemoteFile("Botswana.mat", _EHU + "7/72/Botswana.mat",
                   "f1603903c844cdc2980550b0180688e8e1a72d4292595d1120e1dec2a80a91c7", 78911133),
        RemoteFile("Botswana_gt.mat", _EHU + "5/58/Botswana_gt.mat", None, None),  # single-source digest
        "Botswana", "Botswana_gt",
        ("Water", "Hippo grass", "Floodplain grasses 1", "Floodplain grasses 2", "Reeds", "Riparian", "Firescar",
         "Island interior", "Acacia woodlands", "Acacia shrublands", "Acacia grasslands", "Short mopane",
         "Mixed mopane", "Exposed soils"),
        None, None,
    ),
    SceneSpec(
        "houston2013", "Houston 2013 (GRSS DFC)", "CASI-1500 (380-1050 nm)", (349, 1905, 144),
        RemoteFile("2013_IEEE_GRSS_DF_Contest_CASI.tif", None, None, None),
        RemoteFile("houston2013_gt.tif", None, None, None),  # rasterised contest ROIs, see data/README.md
        None, None,
        ("Healthy grass", "Stressed grass", "Synthetic grass", "Trees", "Soil", "Water", "Residential",
         "Commercial", "Road", "Highway", "Railway", "Parking Lot 1", "Parking Lot 2", "Tennis Court",
         "Running Track"),
        None, None,
        description="Distributed by the IEEE GRSS after registration; place the files by hand.",
    ),
    SceneSpec(
        "samson", "Samson (unmixing)", "unknown (401-889 nm)", (95, 95, 156),
        RemoteFile("samson_1.mat", _MIRROR + "samson_1.mat",
                   "1ebacaf7cd32bfc31c0ee3fd56c63a7f29a434893a8b45705fb59cd8a0c8beb6", 3604014),
        RemoteFile("Samson.mat", None,
                   "49530e80d0dabf6b1fb9cde2d6cf257f89a344afe9c13b2cc912eb22f344de18", 3735621),
        "V", "S_GT", ("Rock/soil", "Tree", "Water"), None, None,
        description="Unmixing scene: read it with load_unmixing. Samson.mat stands in for the original end3.mat.",
    ),
    SceneSpec(
        "jasper_ridge", "Jasper Ridge (unmixing)", "AVIRIS", (100, 100, 198),
        RemoteFile("jasperRidge2_R198.mat", _MIRROR + "jasperRidge2_R198.mat",
                   "0e4118a6452f6044978a8ca3762fb0f791115467904936d463c4e111e56e682e", 2987224),
        RemoteFile("end4.mat", None,  # inside the GroundTruth.zip of the original distribution
                   "92f5697b43705802b904fd13ba99b6ce65a3d203682864abc3fbec922beec374", 178271),
        "Y", "A", ("Tree", "Water", "Dirt", "Road"), None, None,
        description="Unmixing scene: read it with load_unmixing.",
    ),
    SceneSpec(
        "synthetic_tiny", "Synthetic tiny scene", "synthetic", (24, 24, 32), _GENERATED, _GENERATED, None, None,
        ("Class 1", "Class 2", "Class 3", "Class 4"), None, None,
        description="Linear mixture of synthetic spectra over 400-2500 nm, for tests and demos.",
    ),
    SceneSpec(
        "synthetic_indian_pines", "Synthetic Indian Pines", "synthetic", (145, 145, 200), _GENERATED, _GENERATED,
        None, None, INDIAN_PINES_CLASSES, None, INDIAN_PINES_200_NM,
        description="Indian Pines sizes, bands and class counts with synthetic spectra; no download needed.",
    ),
)  # fmt: skip
_SCENES = {spec.name: spec for spec in _SPECS}
_UNMIXING = ("samson", "jasper_ridge")
_SYNTHETIC_LABELLED_FRACTION = {"synthetic_tiny": 0.6, "synthetic_indian_pines": 10249 / (145 * 145)}
_SYNTHETIC_FREQUENCIES = {"synthetic_indian_pines": INDIAN_PINES_CLASS_COUNTS}
_FOLDERS = {"indian_pines_raw": "indian_pines"}  # variants that share a folder (and ground truth) with another


def list_scenes() -> list[str]:
    """Return the names of every registered scene, sorted."""
    return sorted(_SCENES)


def get_scene_spec(name: str) -> SceneSpec:
    """Return the registered spec of scene `name`; an unknown name raises a DataError listing the valid ones."""
    if name not in _SCENES:
        raise DataError(f"Unknown scene {name!r}. Known scenes: {', '.join(list_scenes())}.")
    return _SCENES[name]


def default_data_root() -> Path:
    """Return where scenes are cached: $HSLITE_DATA when set, else the user cache directory of hslite."""
    if os.environ.get("HSLITE_DATA"):
        return Path(os.environ["HSLITE_DATA"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("hslite"))


def scene_folder(name: str, root: str | Path | None = None) -> Path:
    """Return the folder that holds the files of scene `name` under `root` (default: `default_data_root()`)."""
    base = Path(root).expanduser() if root is not None else default_data_root()
    return base / _FOLDERS.get(name, name)


def is_synthetic(name: str) -> bool:
    """Return True for scenes generated from a seed rather than read from files."""
    return get_scene_spec(name).cube_file is _GENERATED


# ---------------------------------------------------------------------------------------------------------- scene
@dataclass
class Scene:
    """A labelled hyperspectral scene in memory: cube (H, W, B) float32 and ground truth (H, W) int64, 0 unlabelled."""

    name: str
    cube: np.ndarray
    gt: np.ndarray
    class_names: list[str]
    wavelengths_nm: np.ndarray | None
    crs: Any | None = None
    transform: Any | None = None

    @property
    def num_classes(self) -> int:
        """Number of classes C; labels run 1..C."""
        return len(self.class_names)

    @property
    def num_bands(self) -> int:
        """Number of spectral bands B of the cube."""
        return int(self.cube.shape[2])

    def plot(self, ax: Any = None, bands: tuple[int, int, int] | None = None) -> Any:
        """Draw a false-colour composite beside the ground truth and return the matplotlib Figure.

        `ax` is None (a new figure) or a pair of Axes; `bands` are the 0-based (red, green, blue) bands, by default
        the bands nearest 860, 650 and 550 nm (colour infrared) or, without wavelengths, three spread-out bands.
        """
        from matplotlib.figure import Figure

        if ax is None:
            figure = Figure(figsize=(9, 4.5), layout="constrained")
            ax = figure.subplots(1, 2)
        rgb = self.cube[:, :, list(bands or self._default_rgb_bands())].astype(np.float64)
        low, high = np.percentile(rgb, (2, 98), axis=(0, 1))
        rgb = np.clip((rgb - low) / np.where(high > low, high - low, 1.0), 0.0, 1.0)
        ax[0].imshow(rgb)
        ax[0].set_title(f"{self.name}: false colour")
        shown = ax[1].imshow(np.ma.masked_equal(self.gt, 0), cmap="tab20", vmin=1, vmax=max(self.num_classes, 2))
        ax[1].set_title(f"ground truth ({self.num_classes} classes)")
        for axis in ax:
            axis.set_axis_off()
        ax[1].figure.colorbar(shown, ax=ax[1], shrink=0.8)
        return ax[0].figure

    def _default_rgb_bands(self) -> tuple[int, int, int]:
        if self.wavelengths_nm is not None and self.wavelengths_nm.min() < 650 < self.wavelengths_nm.max():
            red, green, blue = (int(np.abs(self.wavelengths_nm - nm).argmin()) for nm in (860.0, 650.0, 550.0))
            return red, green, blue
        b = self.num_bands
        return (3 * b // 4, b // 2, b // 4)


def load_scene(name: str, root: str | Path | None = None, download: bool = False, seed: int = 0) -> Scene:
    """Load scene `name` from `<root>/<scene>/<file>` (downloading when allowed), or generate it if synthetic.

    Raw ground-truth codes are mapped to classes 1..C (`SceneSpec.label_values`); the cube is returned with all its
    bands as distributed. `seed` only affects synthetic scenes.
    """
    spec = get_scene_spec(name)
    if is_synthetic(name):
        from hslite.datasets.synthetic import make_synthetic_scene

        height, width, bands = spec.shape
        return make_synthetic_scene(
            height, width, bands, len(spec.class_names), _SYNTHETIC_FREQUENCIES.get(name), seed=seed,
            labelled_fraction=_SYNTHETIC_LABELLED_FRACTION[name], wavelengths_nm=spec.wavelengths_nm,
            class_names=spec.class_names, name=name,
        )  # fmt: skip
    if name in _UNMIXING:
        raise DataError(f"{name} is an unmixing scene without class labels; read it with load_unmixing({name!r}).")
    folder = scene_folder(name, root)
    cube_path = ensure_file(spec.cube_file, folder, download)
    gt_path = ensure_file(spec.gt_file, folder, download)
    cube, crs, transform = read_cube(cube_path, spec.cube_key)
    raw_gt = read_labels(gt_path, spec.gt_key)
    if cube.shape != spec.shape:
        raise DataError(
            f"{cube_path} holds a cube of shape {cube.shape} (rows, cols, bands) but {name} is {spec.shape}. "
            "Check that the file is the variant this scene names (e.g. indian_pines is the 200-band cube, "
            "indian_pines_raw the 220-band one)."
        )
    if raw_gt.shape != cube.shape[:2]:
        raise DataError(
            f"{gt_path} is a {raw_gt.shape} label map but the cube is {cube.shape[:2]}; they are not the same scene."
        )
    gt = _map_labels(raw_gt, spec, gt_path)
    wavelengths = np.asarray(spec.wavelengths_nm, dtype=np.float64) if spec.wavelengths_nm else None
    return Scene(name, cube, gt, list(spec.class_names), wavelengths, crs, transform)


def _map_labels(raw_gt: np.ndarray, spec: SceneSpec, path: Path) -> np.ndarray:
    if spec.label_values is None:
        check_labels(raw_gt, len(spec.class_names))
        return raw_gt
    lookup = {code: index for index, code in enumerate((0, *spec.label_values))}
    codes = np.unique(raw_gt)
    unknown = [int(code) for code in codes if int(code) not in lookup]
    if unknown:
        raise DataError(
            f"{path} has label codes {unknown} that {spec.name} does not define (known: 0 and {spec.label_values})."
        )
    table = np.zeros(int(codes.max()) + 1, dtype=np.int64)
    for code in codes:
        table[code] = lookup[int(code)]
    return table[raw_gt]


# -------------------------------------------------------------------------------------------------------- unmixing
def load_unmixing(name: str, root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Load an unmixing scene: cube (H, W, B) float32, endmembers (K, B) and abundances (H, W, K).

    The files store pixels as columns in MATLAB column-major order (pixel j = col * rows + row), so a (B, N) matrix
    becomes (H, W, B) by reshaping to (B, cols, rows) and transposing. Files are never downloaded here.
    """
    if name not in _UNMIXING:
        raise DataError(f"{name!r} is not an unmixing scene; unmixing scenes are {', '.join(_UNMIXING)}.")
    spec = get_scene_spec(name)
    folder = scene_folder(name, root)
    data = read_mat(ensure_file(spec.cube_file, folder, download=False))
    truth = read_mat(ensure_file(spec.gt_file, folder, download=False))
    rows, cols, bands = spec.shape
    if name == "samson":
        pixels = data["V"]
        endmembers = truth["GT"]  # (K, B), each scaled to a maximum of 1
        abundances = truth["S_GT"]  # already (rows, cols, K)
    else:
        pixels = data["Y"] / float(np.squeeze(data["maxValue"]))  # uint16 counts -> reflectance
        endmembers = truth["M"].T
        abundances = _columns_to_image(truth["A"], rows, cols)
    if pixels.shape != (bands, rows * cols):
        raise DataError(f"{name}: the cube matrix is {pixels.shape}, expected {(bands, rows * cols)}.")
    cube = _columns_to_image(pixels, rows, cols).astype(np.float32)
    return cube, np.asarray(endmembers, dtype=np.float64), np.ascontiguousarray(abundances, dtype=np.float64)


def _columns_to_image(matrix: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return np.ascontiguousarray(matrix.reshape(matrix.shape[0], cols, rows).transpose(2, 1, 0))
