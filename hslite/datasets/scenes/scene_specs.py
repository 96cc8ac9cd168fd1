"""The specs of every scene hslite knows: files, shape as distributed, classes, bands and wavelengths.

Files live at `<root>/<scene folder>/<original file name>`; each file's source URL and sha256 are in its spec here
(None where no trustworthy digest is known; data/README.md says which scenes download). `registry` looks them up by
name.
"""

from __future__ import annotations

from dataclasses import dataclass

from hslite.datasets.scenes.fetch import RemoteFile
from hslite.datasets.scenes.synthetic import FIELD_CONCENTRATION
from hslite.datasets.scenes.wavelengths import INDIAN_PINES_220_NM


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
    class_counts: tuple[int, ...] | None = None  # synthetic stand-ins: labelled pixels per class of the real scene
    # Synthetic stand-ins: how closely each field keeps to its class's mixture, calibrated against the real scene
    # where it is known (lower = fields of one class differ more, unseen fields are harder).
    field_concentration: float = FIELD_CONCENTRATION


# ------------------------------------------------------------------------------------------------------ reference
_EHU = "https://www.ehu.eus/ccwintco/uploads/"
_MIRROR = "https://raw.githubusercontent.com/ricardoborsoi/MUA_SparseUnmixing/master/real_data/"
# The cube and ground-truth "file" of a synthetic scene: nothing to fetch, the arrays are generated from a seed.
GENERATED_FILE = RemoteFile(name="(generated from the seed)", url=None, sha256=None, size_bytes=None)

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


def _stand_in(
    real: str,
    title: str,
    shape: tuple[int, int, int],
    classes: tuple[str, ...],
    counts: tuple[int, ...],
    wavelengths_nm: tuple[float, ...] | None = None,
    where: str = "",
    field_concentration: float = FIELD_CONCENTRATION,
) -> SceneSpec:
    """`synthetic_<real>`: the real scene's size, bands, classes and class counts, with synthetic spectra."""
    return SceneSpec(
        f"synthetic_{real}", f"Synthetic {title}", "synthetic", shape, GENERATED_FILE, GENERATED_FILE, None, None,
        classes, None, wavelengths_nm, class_counts=counts, field_concentration=field_concentration,
        description=f"{title} sizes, bands and class counts with synthetic spectra{where}.",
    )  # fmt: skip


def _even_nm(first: float, last: float, bands: int) -> tuple[float, ...]:
    """Band centres evenly spaced over a sensor's range, for a stand-in of a scene whose file carries none."""
    return tuple(first + (last - first) * i / (bands - 1) for i in range(bands))


SALINAS_CLASSES = (
    "Brocoli_green_weeds_1", "Brocoli_green_weeds_2", "Fallow", "Fallow_rough_plow", "Fallow_smooth", "Stubble",
    "Celery", "Grapes_untrained", "Soil_vinyard_develop", "Corn_senesced_green_weeds", "Lettuce_romaine_4wk",
    "Lettuce_romaine_5wk", "Lettuce_romaine_6wk", "Lettuce_romaine_7wk", "Vinyard_untrained",
    "Vinyard_vertical_trellis",
)  # fmt: skip
PAVIA_UNIVERSITY_CLASSES = (
    "Asphalt", "Meadows", "Gravel", "Trees", "Painted metal sheets", "Bare Soil", "Bitumen", "Self-Blocking Bricks",
    "Shadows",
)  # fmt: skip
HOUSTON2013_CLASSES = (
    "Healthy grass", "Stressed grass", "Synthetic grass", "Trees", "Soil", "Water", "Residential", "Commercial", "Road",
    "Highway", "Railway", "Parking Lot 1", "Parking Lot 2", "Tennis Court", "Running Track",
)  # fmt: skip
# Labelled pixels per class of PaviaU_gt.mat and Salinas_gt.mat (counted from the EHU files), and of the
# contest's training + test ROIs of Houston 2013: what the synthetic stand-ins copy.
PAVIA_UNIVERSITY_CLASS_COUNTS = (6631, 18649, 2099, 3064, 1345, 5029, 1330, 3682, 947)
SALINAS_CLASS_COUNTS = (2009, 3726, 1976, 1394, 2678, 3959, 3579, 11271, 6203, 3278, 1068, 1927, 916, 1070, 7268, 1807)
HOUSTON2013_CLASS_COUNTS = (1251, 1254, 697, 1244, 1242, 325, 1268, 1244, 1252, 1227, 1235, 1233, 469, 428, 660)
_SALINAS_A_CODES = (1, 10, 11, 12, 13, 14)

SCENE_SPECS = (
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
        # the file carries no band centres: 103 of ROSIS's 115 bands over 430-860 nm
        "paviaU", "paviaU_gt", PAVIA_UNIVERSITY_CLASSES, None, None,
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
        None, None, HOUSTON2013_CLASSES, None, None,
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
        "synthetic_tiny", "Synthetic tiny scene", "synthetic", (24, 24, 32), GENERATED_FILE, GENERATED_FILE,
        None, None, ("Class 1", "Class 2", "Class 3", "Class 4"), None, None,
        description="Linear mixture of synthetic spectra over 400-2500 nm, for tests and demos.",
    ),
    # At a field concentration of 15 the better RBF-SVM scores on the stand-in within 0.3 OA points of the real cube
    # on both protocols, and indian_pines_1gpu within 1.1 stratified; on disjoint blocks the recipe scores 16 points
    # more than on the real cube (benchmarks/time_to_accuracy.py --stand-ins-too). The other stand-ins keep the
    # generator's default until they are calibrated against their own scenes.
    _stand_in("indian_pines", "Indian Pines", (145, 145, 200), INDIAN_PINES_CLASSES, INDIAN_PINES_CLASS_COUNTS,
              INDIAN_PINES_200_NM, "; no download needed", field_concentration=15.0),
    # Stand-ins for the scenes whose cubes are large or distributed under registration: the recipes of those scenes
    # run on them where the real files are absent (benchmarks/time_to_accuracy.py).
    _stand_in("pavia_university", "Pavia University", (610, 340, 103), PAVIA_UNIVERSITY_CLASSES,
              PAVIA_UNIVERSITY_CLASS_COUNTS, _even_nm(430, 860, 103), " over 430-860 nm"),
    _stand_in("salinas", "Salinas", (512, 217, 204), SALINAS_CLASSES, SALINAS_CLASS_COUNTS),
    _stand_in("houston2013", "Houston 2013", (349, 1905, 144), HOUSTON2013_CLASSES, HOUSTON2013_CLASS_COUNTS,
              _even_nm(380, 1050, 144), " over 380-1050 nm"),
)  # fmt: skip
