"""Your own cube by path: recognised as a path, read and checked like a registered scene, described by `data info`."""

from __future__ import annotations

import pickle

import fixtures_data as fx
import numpy as np
import pytest

from hslite.cli import main
from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.scenes.own_scene import OwnScene, is_scene_path, split_key
from hslite.datasets.settings import DataSettings
from hslite.errors import ConfigError, DataError

CODES = (3, 7, 9)  # the user's codes; 0 is unlabelled


def _labels(rows: int = 12, cols: int = 10) -> np.ndarray:
    classes = fx.tiny_labels(rows, cols, num_classes=len(CODES))
    return np.array((0, *CODES), dtype=np.uint8)[classes]


@pytest.fixture
def own_files(tmp_path):
    """A 12x10x6 ENVI cube (wavelengths in µm in its header) and a georeferenced GeoTIFF of codes 0, 3, 7, 9."""
    cube = fx.tiny_cube(12, 10, 6, dtype=np.int16)
    hdr = fx.write_envi(tmp_path / "cube.hdr", cube)
    _set_header_wavelengths_um(hdr, np.linspace(0.45, 0.95, 6))
    crs, transform = fx.write_geotiff_cube(tmp_path / "gt.tif", _labels()[:, :, None])
    return {"cube": hdr, "labels": tmp_path / "gt.tif", "array": cube, "crs": crs, "transform": transform}


def _set_header_wavelengths_um(hdr, microns) -> None:
    listed = ", ".join(f"{w:.3f}" for w in microns)
    hdr.write_text(hdr.read_text() + f"wavelength units = Micrometers\nwavelength = {{{listed}}}\n")


def test_a_path_is_recognised_and_a_registered_name_stays_a_name():
    assert not is_scene_path("salinas_a") and not is_scene_path("synthetic_tiny")
    assert is_scene_path("cube.hdr") and is_scene_path("data/cube") and is_scene_path("scene.mat:cube")
    assert split_key("a/scene.mat:cube") == (split_key("a/scene.mat")[0], "cube")
    assert split_key("a/b:c.tif")[1] is None  # a colon elsewhere is part of the path


def test_codes_become_classes_with_names_wavelengths_and_the_labels_georeference(own_files):
    scene = OwnScene.from_paths(str(own_files["cube"]), str(own_files["labels"]), class_names=["a", "b", "c"]).load()
    raw = _labels()
    assert scene.label_codes == CODES and scene.class_names == ["a", "b", "c"]
    np.testing.assert_array_equal(scene.gt, np.searchsorted(CODES, raw) * (raw > 0) + (raw > 0))
    np.testing.assert_array_equal(scene.cube, own_files["array"])
    np.testing.assert_allclose(scene.wavelengths_nm, np.linspace(450, 950, 6), atol=1e-6)  # µm header -> nm
    assert scene.crs == own_files["crs"] and scene.transform == own_files["transform"]  # the cube has none


def test_the_cubes_own_georeference_wins_over_the_labels(own_files):
    hdr = own_files["cube"]
    hdr.write_text(hdr.read_text() + "map info = {UTM, 1, 1, 500000, 4000000, 30, 30, 10, North, WGS-84}\n")
    scene = OwnScene.from_paths(str(hdr), str(own_files["labels"])).load()
    assert scene.crs.to_epsg() == 32610 and tuple(scene.transform)[:6] == (30, 0, 500000, 0, -30, 4000000)


def test_ignore_label_and_a_wavelengths_file(own_files, tmp_path):
    (tmp_path / "bands.txt").write_text("400, 500, 600\n700 800 900\n")
    scene = OwnScene.from_paths(
        str(own_files["cube"]), str(own_files["labels"]), str(tmp_path / "bands.txt"), ignore_label=9
    ).load()
    assert scene.label_codes == (0, 3, 7) and scene.class_names == ["class 0", "class 3", "class 7"]
    assert (scene.gt == 0).sum() == (_labels() == 9).sum()
    np.testing.assert_array_equal(scene.wavelengths_nm, [400, 500, 600, 700, 800, 900])
    (tmp_path / "short.txt").write_text("400 500")
    with pytest.raises(DataError, match="2 band centres but the cube has 6 bands"):
        OwnScene.from_paths(str(own_files["cube"]), str(own_files["labels"]), str(tmp_path / "short.txt")).load()
    with pytest.raises(DataError, match="2 names but .* 3 classes"):
        OwnScene.from_paths(str(own_files["cube"]), str(own_files["labels"]), class_names=["a", "b"]).load()


def test_a_mat_variable_is_named_after_a_colon(tmp_path):
    cube, labels = fx.tiny_cube(), fx.tiny_labels()
    path = fx.write_mat(tmp_path / "scene.mat", small=cube[:, :, :2], cube=cube, gt=labels)
    picked = OwnScene.from_paths(f"{path}:small", f"{path}:gt").load()
    assert picked.cube.shape == (7, 6, 2) and picked.label_codes == (1, 2, 3)
    assert OwnScene.from_paths(str(path), str(path)).load().cube.shape == (7, 6, 5)  # no name: the largest cube
    with pytest.raises(DataError, match="no 3-D numeric variable 'nope'.*small"):
        OwnScene.from_paths(f"{path}:nope", str(path)).load()


def test_the_datamodule_pickles_the_paths_and_a_spawned_rank_rebuilds_the_same_split(own_files):
    module = HSIDataModule(DataSettings(scene=str(own_files["cube"]), labels=str(own_files["labels"]), patch_size=3))
    module.setup("fit")
    rank = pickle.loads(pickle.dumps(module))
    assert rank._scene is None and rank.own_scene == module.own_scene
    rank.setup("fit")
    np.testing.assert_array_equal(rank.split.train, module.split.train)
    assert rank.num_classes == 3 and rank.num_bands == 6


def _fit(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["fit", "model.name=cnn1d", "data.patch_size=1", "train.progress=false", *overrides])
    return code, capsys.readouterr().err


def test_a_missing_label_file_names_it_before_any_run_folder(own_files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = _fit(capsys, f"data.scene={own_files['cube']}", "data.labels=absent/gt.tif")
    assert code == 1 and "absent/gt.tif (data.labels) does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    code, err = _fit(capsys, f"data.scene={own_files['cube']}")
    assert code == 2 and "data.labels=PATH" in err
    code, err = _fit(capsys, "data.scene=salinas_a", f"data.labels={own_files['labels']}")
    assert code == 2 and "registered scene" in err


def test_shape_mismatch_and_nan_are_data_errors(own_files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "small_gt.npy", _labels(11, 10))
    code, err = _fit(capsys, f"data.scene={own_files['cube']}", "data.labels=small_gt.npy")
    assert code == 1 and "(11, 10) label map but the cube" in err and "(12, 10)" in err
    cube = own_files["array"].astype(np.float32)
    cube[4, 5, 2] = np.nan
    np.save(tmp_path / "nan.npy", cube)
    code, err = _fit(capsys, "data.scene=nan.npy", f"data.labels={own_files['labels']}")
    assert code == 1 and "1 NaN/Inf values, the first at (row, col, band) (4, 5, 2)" in err
    assert not (tmp_path / "runs").exists()


def test_data_info_describes_a_cube_and_a_label_file(own_files, capsys):
    assert main(["data", "info", str(own_files["cube"])]) == 0
    out = capsys.readouterr().out
    assert "cube, 12×10 pixels, 6 bands, int16 on disk" in out and "450.0–950.0 nm" in out
    assert main(["data", "info", str(own_files["labels"])]) == 0
    out = capsys.readouterr().out
    counts = dict(zip(*np.unique(_labels(), return_counts=True), strict=True))
    assert "label map, 12×10 pixels, 4 codes" in out and "EPSG:32615" in out
    assert ", ".join(f"{code}: {n}" for code, n in counts.items()) in out
    with pytest.raises(ConfigError):
        OwnScene.from_paths(str(own_files["cube"]), None)
