"""Scene registry, readers of every format, checksums and downloads; real files from ../shared/data when present."""

from __future__ import annotations

import dataclasses
import shutil

import fixtures_data as fx
import numpy as np
import pytest

from hslite.datasets.scenes import fetch, scene_specs
from hslite.datasets.scenes import registry as scenes
from hslite.datasets.scenes.fetch import RemoteFile, ensure_file, sha256_file
from hslite.datasets.scenes.geotiff_out import write_geotiff
from hslite.datasets.scenes.io import open_cube, read_cube, read_labels
from hslite.datasets.scenes.registry import get_scene_spec, list_scenes, load_scene, load_unmixing
from hslite.errors import DataError

# ---------------------------------------------------------------------------------------------------------- registry


def test_registry_lists_every_scene_and_rejects_unknown_names():
    names = list_scenes()
    expected = {"indian_pines", "indian_pines_raw", "pavia_university", "salinas", "salinas_a", "ksc", "botswana",
                "houston2013", "samson", "jasper_ridge", "synthetic_tiny", "synthetic_indian_pines"}  # fmt: skip
    for name in expected:
        assert name in names
    with pytest.raises(DataError, match="indian_pines.*salinas_a"):
        get_scene_spec("indian_pine")


def test_specs_are_consistent():
    for name in list_scenes():
        spec = get_scene_spec(name)
        rows, cols, bands = spec.shape
        assert rows > 0 and cols > 0 and bands > 0
        if spec.wavelengths_nm is not None:
            assert len(spec.wavelengths_nm) == bands
        assert all(0 <= b < bands for b in spec.water_bands)
        for remote in (spec.cube_file, spec.gt_file):
            assert remote.sha256 is None or len(remote.sha256) == 64
    raw, corrected = get_scene_spec("indian_pines_raw"), get_scene_spec("indian_pines")
    assert len(raw.water_bands) == 20 and raw.water_bands[0] == 103 and raw.water_bands[-1] == 219
    kept = [w for i, w in enumerate(raw.wavelengths_nm) if i not in raw.water_bands]
    assert tuple(kept) == corrected.wavelengths_nm
    assert raw.wavelengths_nm[0] == 400.02 and raw.wavelengths_nm[-1] == 2498.96
    salinas_a = get_scene_spec("salinas_a")
    assert salinas_a.label_values == (1, 10, 11, 12, 13, 14) and len(salinas_a.class_names) == 6
    assert get_scene_spec("houston2013").cube_file.url is None


def test_default_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HSLITE_DATA", str(tmp_path))
    assert scenes.default_data_root() == tmp_path
    monkeypatch.delenv("HSLITE_DATA")
    assert "hslite" in str(scenes.default_data_root())


def test_synthetic_scenes_are_deterministic_and_shaped_like_indian_pines():
    scene = load_scene("synthetic_indian_pines", seed=0)
    assert scene.cube.shape == (145, 145, 200) and scene.cube.dtype == np.float32 and np.isfinite(scene.cube).all()
    assert np.bincount(scene.gt.ravel())[1:].tolist() == list(scene_specs.INDIAN_PINES_CLASS_COUNTS)
    assert scene.class_names == list(scene_specs.INDIAN_PINES_CLASSES)
    np.testing.assert_array_equal(load_scene("synthetic_indian_pines", seed=0).cube, scene.cube)
    assert not np.array_equal(load_scene("synthetic_indian_pines", seed=1).gt, scene.gt)


def test_the_indian_pines_stand_in_has_fields_of_one_class_as_unlike_as_the_real_ones():
    """Its fields keep to their class's mixture at the calibrated concentration, looser than the generator's default,
    so the spread of field means within a class (what makes unseen fields hard) is wider."""
    from scipy import ndimage

    from hslite.datasets.scenes.synthetic import FIELD_CONCENTRATION, make_synthetic_scene

    spec = scenes.get_scene_spec("synthetic_indian_pines")
    assert spec.field_concentration < FIELD_CONCENTRATION
    assert scenes.get_scene_spec("synthetic_salinas").field_concentration == FIELD_CONCENTRATION  # not calibrated
    scene = load_scene("synthetic_indian_pines", seed=0)
    counts, labelled = spec.class_counts, sum(spec.class_counts) / (145 * 145)
    kwargs = {"seed": 0, "labelled_fraction": labelled, "wavelengths_nm": spec.wavelengths_nm}
    tight, _, _ = make_synthetic_scene(145, 145, 200, 16, counts, field_concentration=FIELD_CONCENTRATION, **kwargs)
    loose, gt, _ = make_synthetic_scene(
        145, 145, 200, 16, counts, field_concentration=spec.field_concentration, **kwargs
    )
    np.testing.assert_array_equal(loose, scene.cube)

    def field_spread(cube: np.ndarray) -> float:
        """Mean over classes of the spread of their fields' mean spectra (fields: connected labelled regions)."""
        spreads = []
        for cls in range(1, 17):
            fields, n = ndimage.label(gt == cls)
            means = np.stack([cube[fields == f].mean(axis=0) for f in range(1, n + 1)])
            spreads.append(means.std(axis=0).mean() if n > 1 else 0.0)
        return float(np.mean(spreads))

    assert field_spread(loose) > 1.5 * field_spread(tight)


@pytest.mark.parametrize(
    ("stand_in", "real"),
    [("synthetic_pavia_university", "pavia_university"), ("synthetic_salinas", "salinas"),
     pytest.param("synthetic_houston2013", "houston2013", marks=pytest.mark.slow)],  # 665k pixels: ~10 s
)  # fmt: skip
def test_stand_ins_have_their_scenes_size_bands_classes_and_class_counts(stand_in: str, real: str) -> None:
    spec, scene = scenes.get_scene_spec(real), load_scene(stand_in, seed=0)
    assert scene.cube.shape == spec.shape and scenes.is_synthetic(stand_in)
    assert scene.class_names == list(spec.class_names)
    assert np.bincount(scene.gt.ravel())[1:].tolist() == list(scenes.get_scene_spec(stand_in).class_counts)


@pytest.mark.parametrize("real", ["pavia_university", "salinas"])
def test_stand_in_class_counts_are_the_real_ground_truths(real: str, shared_data) -> None:
    spec = scenes.get_scene_spec(real)
    gt = read_labels(shared_data / real / spec.gt_file.name, spec.gt_key)
    counts = np.bincount(gt.ravel().astype(np.int64))[1:].tolist()
    assert counts == list(scenes.get_scene_spec(f"synthetic_{real}").class_counts)


def test_synthetic_tiny_is_learnable_but_not_trivial(tiny_scene):
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    from hslite.datasets.splits import make_split

    split = make_split(tiny_scene.gt, "stratified", train_fraction=0.3, val_fraction=0.1, seed=0)
    features = tiny_scene.cube.reshape(-1, tiny_scene.num_bands)
    flat = lambda coords: coords[:, 0] * tiny_scene.gt.shape[1] + coords[:, 1]  # noqa: E731
    model = LinearDiscriminantAnalysis().fit(features[flat(split.train)], tiny_scene.gt.ravel()[flat(split.train)])
    accuracy = (model.predict(features[flat(split.test)]) == tiny_scene.gt.ravel()[flat(split.test)]).mean()
    assert 0.5 < accuracy < 0.99  # chance is ~0.25: classes separate, but spectra alone do not make it trivial


# ----------------------------------------------------------------------------------------------------------- readers


def test_mat_reader_uses_key_then_largest_array(tmp_path):
    cube, labels = fx.tiny_cube(), fx.tiny_labels()
    path = fx.write_mat(tmp_path / "scene.mat", small=cube[:2, :2], cube=cube, gt=labels)
    data, crs, transform = read_cube(path, "cube")
    assert data.dtype == np.float32 and data.shape == (7, 6, 5) and crs is None and transform is None
    np.testing.assert_array_equal(data, cube)
    np.testing.assert_array_equal(read_cube(path, "missing")[0], cube)  # falls back to the largest 3-D array
    np.testing.assert_array_equal(read_labels(path), labels)
    double_gt = fx.write_mat(tmp_path / "gt.mat", indian_pines_gt=labels.astype(np.float64))
    assert read_labels(double_gt, "indian_pines_gt").dtype == np.int64


def test_mat_without_suitable_array_names_what_it_saw(tmp_path):
    path = fx.write_mat(tmp_path / "odd.mat", vector=np.arange(4.0))
    with pytest.raises(DataError, match="vector"):
        read_cube(path, "cube")
    with pytest.raises(DataError, match="integer label map"):
        read_labels(fx.write_mat(tmp_path / "frac.mat", gt=np.full((3, 3), 0.5)))


def test_corrupt_truncated_and_v73_mat_files(tmp_path):
    path = fx.truncate(fx.write_mat(tmp_path / "cut.mat", cube=fx.tiny_cube()), 0.6)
    with pytest.raises(DataError, match="truncated or corrupt"):
        read_cube(path)
    (tmp_path / "junk.mat").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(DataError, match="junk.mat"):
        read_cube(tmp_path / "junk.mat")
    with pytest.raises(DataError, match="v7.3.*h5py.*-v7"):
        read_cube(fx.write_v73_mat(tmp_path / "new.mat"))


def test_envi_reader(tmp_path):
    cube = fx.tiny_cube(dtype=np.uint16)
    hdr = fx.write_envi(tmp_path / "scene.hdr", cube, wavelengths_nm=np.linspace(400, 900, 5))
    np.testing.assert_array_equal(read_cube(hdr)[0], cube)
    np.testing.assert_array_equal(read_cube(tmp_path / "scene.img")[0], cube)  # data file with the header beside it
    labels = fx.tiny_labels()
    np.testing.assert_array_equal(read_labels(fx.write_envi(tmp_path / "gt.hdr", labels[:, :, None])), labels)


def test_erdas_gis_reader(tmp_path):
    labels = fx.tiny_labels(num_classes=16)
    labels[0, 0] = 200  # above 127: must not come back negative
    np.testing.assert_array_equal(read_labels(fx.write_erdas_gis(tmp_path / "map.GIS", labels)), labels)


def test_geotiff_cube_keeps_crs_and_transform_and_labels_round_trip(tmp_path):
    cube = fx.tiny_cube(dtype=np.uint16)
    crs, transform = fx.write_geotiff_cube(tmp_path / "casi.tif", cube)
    data, got_crs, got_transform = read_cube(tmp_path / "casi.tif")
    np.testing.assert_array_equal(data, cube)
    assert got_crs == crs and got_transform == transform
    labels = fx.tiny_labels().astype(np.int64)
    write_geotiff(tmp_path / "out" / "prediction.tif", labels, crs, transform)
    np.testing.assert_array_equal(read_labels(tmp_path / "out" / "prediction.tif"), labels)
    assert read_cube(tmp_path / "out" / "prediction.tif")[1] == crs
    write_geotiff(tmp_path / "plain.tif", labels - 1, None, None)  # -1 = unlabelled, no georeference
    np.testing.assert_array_equal(read_labels(tmp_path / "plain.tif"), labels - 1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["prediction.tif"]  # no temp file left


def test_npy_and_unknown_formats(tmp_path):
    np.save(tmp_path / "cube.npy", fx.tiny_cube())
    assert read_cube(tmp_path / "cube.npy")[0].shape == (7, 6, 5)
    (tmp_path / "cube.xyz").write_text("?")
    with pytest.raises(DataError, match="unknown format"):
        read_cube(tmp_path / "cube.xyz")
    with pytest.raises(DataError, match="does not exist"):
        read_labels(tmp_path / "absent.npy")


# ---------------------------------------------------------------------------------------------- load_scene checks


@pytest.fixture()
def tiny_registered(monkeypatch, tmp_path):
    """Register a 3-class scene "tiny_mat" whose files live in tmp_path/tiny_mat."""
    spec = dataclasses.replace(
        get_scene_spec("indian_pines"), name="tiny_mat", shape=(7, 6, 5), class_names=("a", "b", "c"),
        cube_file=RemoteFile("tiny.mat", None, None, None), gt_file=RemoteFile("tiny_gt.mat", None, None, None),
        cube_key="tiny", gt_key="tiny_gt", wavelengths_nm=(500.0, 600.0, 700.0, 800.0, 900.0), water_bands=(),
    )  # fmt: skip
    monkeypatch.setitem(scenes._SCENES, "tiny_mat", spec)
    folder = tmp_path / "tiny_mat"
    folder.mkdir()
    return spec, folder


def test_load_scene_from_tiny_files(tiny_registered, tmp_path):
    spec, folder = tiny_registered
    fx.write_mat(folder / "tiny.mat", tiny=fx.tiny_cube())
    fx.write_mat(folder / "tiny_gt.mat", tiny_gt=fx.tiny_labels())
    scene = load_scene("tiny_mat", tmp_path)
    assert scene.cube.shape == (7, 6, 5) and scene.gt.dtype == np.int64 and scene.num_classes == 3
    assert scene.num_bands == 5 and scene.wavelengths_nm.shape == (5,)
    figure = scene.plot()
    assert len(figure.axes) >= 2


def test_load_scene_rejects_shape_mismatch_and_foreign_labels(tiny_registered, tmp_path):
    spec, folder = tiny_registered
    fx.write_mat(folder / "tiny.mat", tiny=fx.tiny_cube())
    fx.write_mat(folder / "tiny_gt.mat", tiny_gt=fx.tiny_labels(rows=6))
    with pytest.raises(DataError, match=r"\(6, 6\) label map but the cube is \(7, 6\)"):
        load_scene("tiny_mat", tmp_path)
    fx.write_mat(folder / "tiny_gt.mat", tiny_gt=fx.tiny_labels(num_classes=5))
    with pytest.raises(DataError, match="outside 0..3"):
        load_scene("tiny_mat", tmp_path)
    fx.write_mat(folder / "tiny.mat", tiny=fx.tiny_cube(bands=4))
    with pytest.raises(DataError, match=r"shape \(7, 6, 4\).*\(7, 6, 5\)"):
        load_scene("tiny_mat", tmp_path)


def test_missing_file_says_where_to_put_it(tmp_path):
    with pytest.raises(DataError) as error:
        load_scene("indian_pines", tmp_path)
    message = str(error.value)
    assert "Indian_pines_corrected.mat" in message and str(tmp_path / "indian_pines") in message
    assert "https://www.ehu.eus/" in message and "download" in message
    with pytest.raises(DataError, match="no public download URL.*data/README.md"):
        load_scene("houston2013", tmp_path)
    with pytest.raises(DataError, match="load_unmixing"):
        load_scene("samson", tmp_path)


# ------------------------------------------------------------------------------------------- checksums, downloads


def _remote_for(path, **changes) -> RemoteFile:
    remote = RemoteFile("fetched.mat", path.as_uri(), sha256_file(path), path.stat().st_size)
    return dataclasses.replace(remote, **changes)


def test_download_verifies_and_caches_checksum(tmp_path, monkeypatch):
    source = fx.write_mat(tmp_path / "source.mat", cube=fx.tiny_cube())
    remote = _remote_for(source)
    folder = tmp_path / "cache" / "scene"
    with pytest.raises(DataError, match="data.download=true"):
        ensure_file(remote, folder, download=False)
    path = ensure_file(remote, folder, download=True)
    assert path.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == ["fetched.mat"]  # nothing written beside the data
    hashed = []
    monkeypatch.setattr(fetch, "sha256_file", lambda p: hashed.append(p) or "0" * 64)
    ensure_file(remote, folder, download=False)  # cached for this path, size and mtime: no re-hash
    assert hashed == []
    moved = folder.parent / "moved" / "fetched.mat"
    moved.parent.mkdir()
    path.rename(moved)
    with pytest.raises(DataError, match="sha256 0{64}"):  # a moved file is verified again
        ensure_file(remote, moved.parent, download=False)


def test_checksum_mismatch_leaves_nothing_behind(tmp_path):
    source = fx.write_mat(tmp_path / "source.mat", cube=fx.tiny_cube())
    folder = tmp_path / "cache"
    with pytest.raises(DataError, match="sha256.*nothing was saved"):
        ensure_file(_remote_for(source, sha256="f" * 64), folder, download=True)
    assert list(folder.iterdir()) == []
    with pytest.raises(DataError, match="bytes"):
        ensure_file(_remote_for(source, sha256=None, size_bytes=1), folder, download=True)
    assert list(folder.iterdir()) == []


def test_interrupted_download_is_atomic_and_offline_message(tmp_path, monkeypatch):
    source = fx.write_mat(tmp_path / "source.mat", cube=fx.tiny_cube())

    class Broken:
        def __init__(self, *args, **kwargs):
            self.calls = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, n):
            self.calls += 1
            if self.calls > 1:
                raise ConnectionResetError("connection reset by peer")
            return b"partial bytes"

    monkeypatch.setattr(fetch.urllib.request, "urlopen", Broken)
    folder = tmp_path / "cache"
    with pytest.raises(DataError, match="Could not download fetched.mat.*offline.*put it at"):
        ensure_file(_remote_for(source), folder, download=True)
    assert list(folder.iterdir()) == []


def test_existing_file_with_wrong_checksum_is_refused(tmp_path):
    folder = tmp_path / "scene"
    folder.mkdir()
    (folder / "fetched.mat").write_bytes(b"not the file")
    remote = RemoteFile("fetched.mat", "https://example.invalid/fetched.mat", "a" * 64, None)
    with pytest.raises(DataError, match="has sha256 .* should have a{64}.*download it again"):
        ensure_file(remote, folder, download=False)


# ------------------------------------------------------------------------------------------------------ real data


@pytest.mark.realdata
def test_salinas_a_loads_with_its_six_classes(shared_data):
    scene = load_scene("salinas_a", shared_data)
    assert scene.cube.shape == (83, 86, 204) and scene.cube.dtype == np.float32
    assert scene.num_classes == 6
    assert np.bincount(scene.gt.ravel()).tolist() == [1790, 391, 1343, 616, 1525, 674, 799]


@pytest.mark.realdata
def test_real_indian_pines_is_read_as_its_uint16_counts(shared_data):
    path = shared_data / "indian_pines" / get_scene_spec("indian_pines").cube_file.name
    if not path.is_file():
        pytest.skip(f"the real Indian Pines cube is not at {path}")
    opened = open_cube(path)
    assert opened.dtype == np.uint16 and opened.shape == (145, 145, 200)
    cube = load_scene("indian_pines", shared_data).cube
    assert cube.dtype == np.float32 and (cube.min(), cube.max()) == (955.0, 9604.0)  # the EHU file's range


@pytest.mark.realdata
def test_shared_files_match_their_registered_sha256(shared_data):
    checked = 0
    for name in list_scenes():
        spec = get_scene_spec(name)
        folder = scenes.scene_folder(name, shared_data)
        for remote in (spec.cube_file, spec.gt_file):
            if remote.sha256 and (folder / remote.name).is_file():
                ensure_file(remote, folder, download=False)  # raises on mismatch; the folder is read-only
                checked += 1
    assert checked >= 9


@pytest.mark.realdata
@pytest.mark.parametrize(
    ("scene", "counts"),
    [
        ("indian_pines", [46, 1428, 830, 237, 483, 730, 28, 478, 20, 972, 2455, 593, 205, 1265, 386, 93]),
        ("pavia_university", [6631, 18649, 2099, 3064, 1345, 5029, 1330, 3682, 947]),
        ("salinas", [2009, 3726, 1976, 1394, 2678, 3959, 3579, 11271, 6203, 3278, 1068, 1927, 916, 1070, 7268, 1807]),
    ],
)
def test_real_ground_truths_load_beside_a_generated_cube(shared_data, tmp_path, scene, counts):
    spec = get_scene_spec(scene)
    folder = tmp_path / scene
    fx.write_real_format_cube(folder, scene)
    shutil.copy(shared_data / scene / spec.gt_file.name, folder / spec.gt_file.name)
    cube_remote = dataclasses.replace(spec.cube_file, sha256=None, size_bytes=None)  # ours is not the real cube
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(scenes._SCENES, scene, dataclasses.replace(spec, cube_file=cube_remote))
        loaded = load_scene(scene, tmp_path)
    assert loaded.cube.shape == spec.shape
    assert np.bincount(loaded.gt.ravel(), minlength=len(counts) + 1)[1:].tolist() == counts


@pytest.mark.realdata
def test_purdue_label_maps_read_via_spectral_and_rasterio(shared_data):
    gis = read_labels(shared_data / "indian_pines" / "92AV3GT.GIS")
    tif = read_labels(shared_data / "indian_pines" / "19920612_AVIRIS_IndianPine_Site3_gr.tif")
    assert gis.shape == (145, 145) and (gis > 0).sum() == 10366
    np.testing.assert_array_equal(gis, tif)
    ehu = read_labels(shared_data / "indian_pines" / "Indian_pines_gt.mat")
    assert (ehu != gis).sum() == 395


@pytest.mark.realdata
@pytest.mark.parametrize(
    ("scene", "shape", "endmembers"), [("samson", (95, 95, 156), 3), ("jasper_ridge", (100, 100, 198), 4)]
)
def test_unmixing_scenes_load_in_image_order(shared_data, scene, shape, endmembers):
    cube, m, a = load_unmixing(scene, shared_data)
    assert cube.shape == shape and m.shape == (endmembers, shape[2]) and a.shape == (*shape[:2], endmembers)
    np.testing.assert_allclose(a.sum(axis=-1), 1.0, atol=1e-6)
    pixels, mixed = cube.reshape(-1, shape[2]), a.reshape(-1, endmembers) @ m
    cosine = (pixels * mixed).sum(1) / np.linalg.norm(pixels, axis=1) / np.linalg.norm(mixed, axis=1)
    assert cosine.mean() > 0.98  # pixel order right: README reports 0.999 (Samson) and RMSE 0.055 (Jasper)
    if scene == "jasper_ridge":
        assert np.sqrt(((pixels - mixed) ** 2).mean()) < 0.06
