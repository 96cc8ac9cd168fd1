"""Band removal, normalisation and PCA fitted on training pixels only, splits, padding and sanity checks."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial import cKDTree

from hslite.datasets.preprocess import BandNormalizer, PCAReducer, check_finite, kept_bands, pad_reflect
from hslite.datasets.scenes.registry import check_labels, get_scene_spec, load_scene
from hslite.datasets.scenes.scene_specs import INDIAN_PINES_CLASS_COUNTS
from hslite.datasets.splits import Split, audit_leakage, make_split
from hslite.errors import DataError


def _pixels(cube, coords):
    return cube[coords[:, 0], coords[:, 1]]


# ------------------------------------------------------------------------------------------------------------ bands
def test_kept_bands_by_index_and_wavelength_range():
    wavelengths = np.array([400.0, 500.0, 1400.0, 1450.0, 1900.0, 2400.0])
    kept_nm, kept = kept_bands(6, wavelengths, remove_indices=[0], remove_ranges_nm=[(1350, 1500), [1850, 1950]])
    assert kept.tolist() == [1, 5] and kept_nm.tolist() == [500.0, 2400.0]
    all_nm, all_kept = kept_bands(6, None)
    assert all_nm is None and all_kept.tolist() == list(range(6))


def test_kept_bands_errors():
    with pytest.raises(DataError, match=r"\[4\] are outside 0..3"):
        kept_bands(4, None, remove_indices=[4])
    with pytest.raises(DataError, match="no band wavelengths"):
        kept_bands(4, None, remove_ranges_nm=[(1, 2)])
    with pytest.raises(DataError, match="drops all 4"):
        kept_bands(4, None, remove_indices=range(4))


def test_indian_pines_water_bands_by_index_and_by_wavelength_agree():
    spec = get_scene_spec("indian_pines_raw")
    _, by_index = kept_bands(220, spec.wavelengths_nm, remove_indices=spec.water_bands)
    ranges = [(1360, 1405), (1815, 1935), (2495, 2500)]
    _, by_range = kept_bands(220, spec.wavelengths_nm, remove_ranges_nm=ranges)
    assert by_index.size == 200 and by_index.tolist() == by_range.tolist()


# ---------------------------------------------------------------------------------------------------- normalisation
def test_normaliser_never_sees_test_pixels(tiny_scene):
    split = make_split(tiny_scene.gt, "stratified", train_fraction=0.3, val_fraction=0.2, seed=0)
    cube = tiny_scene.cube.copy()
    cube[split.test[:, 0], split.test[:, 1]] = 1e6  # would dominate any statistic that saw them
    cube[split.val[:, 0], split.val[:, 1]] = -1e6
    for method in ("zscore", "stretch2"):
        normaliser = BandNormalizer(method).fit(_pixels(cube, split.train))
        assert np.abs(normaliser.offset).max() < 10 and np.abs(normaliser.scale).max() < 10
    zscore = BandNormalizer("zscore").fit(_pixels(cube, split.train))
    train = _pixels(zscore.transform(cube), split.train)
    np.testing.assert_allclose(train.mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(train.std(axis=0), 1, atol=1e-3)


def test_stretch_clips_to_unit_range_and_state_round_trips():
    rng = np.random.default_rng(0)
    pixels = rng.normal(5, 2, size=(500, 3))
    normaliser = BandNormalizer("stretch2").fit(pixels)
    out = normaliser.transform(pixels.reshape(50, 10, 3))
    assert out.dtype == np.float32 and out.min() == 0.0 and out.max() == 1.0
    assert abs((out == 0).mean() - 0.02) < 0.01 and abs((out == 1).mean() - 0.02) < 0.01  # the 2 % tails clip
    restored = BandNormalizer("none")
    restored.load_state_dict(normaliser.state_dict())
    np.testing.assert_array_equal(restored.transform(pixels), normaliser.transform(pixels))
    constant = BandNormalizer("zscore").fit(np.ones((4, 2)))
    assert np.isfinite(constant.transform(np.ones((2, 2)))).all()
    with pytest.raises(DataError, match="zscore, stretch2, none"):
        BandNormalizer("minmax")
    with pytest.raises(DataError, match="fitted"):
        BandNormalizer("zscore").transform(pixels)


def test_pca_is_fitted_on_training_pixels_only(tiny_scene):
    split = make_split(tiny_scene.gt, "stratified", train_fraction=0.3, val_fraction=0.1, seed=1)
    cube = tiny_scene.cube.copy()
    train_only = PCAReducer(3).fit(_pixels(cube, split.train))
    cube[split.test[:, 0], split.test[:, 1], 0] += 1e4  # a huge direction present only in test pixels
    again = PCAReducer(3).fit(_pixels(cube, split.train))
    np.testing.assert_allclose(again.components, train_only.components)
    out = again.transform(cube)
    assert out.shape == (24, 24, 3) and out.dtype == np.float32
    np.testing.assert_allclose(_pixels(out, split.train).mean(axis=0), 0, atol=1e-4)
    with pytest.raises(DataError, match="at most"):
        PCAReducer(40).fit(_pixels(cube, split.train))


# ------------------------------------------------------------------------------------------------------------ splits
def _as_sets(split):
    return [set(map(tuple, s.tolist())) for s in (split.train, split.val, split.test)]


def test_stratified_split_proportions_and_coverage():
    scene = load_scene("synthetic_indian_pines", seed=0)
    split = make_split(scene.gt, "stratified", train_fraction=0.1, val_fraction=0.1, seed=3)
    train, val, test = _as_sets(split)
    assert not (train & val or train & test or val & test)
    assert len(train | val | test) == int((scene.gt > 0).sum()) == 10249
    counts = split.counts(scene.gt)
    for cls, total in enumerate(INDIAN_PINES_CLASS_COUNTS, 1):
        assert abs(counts["train"][cls] - 0.1 * total) <= 1.5
        assert counts["train"][cls] >= 1
    assert split.train.dtype == np.int64 and split.train.shape[1] == 2


def test_fraction_that_starves_a_class_names_it():
    scene = load_scene("synthetic_indian_pines", seed=0)
    with pytest.raises(DataError, match=r"class 9 \(20 pixels\)"):
        make_split(scene.gt, "stratified", train_fraction=0.04)
    with pytest.raises(DataError, match="train \\+ val < 1"):
        make_split(scene.gt, "stratified", train_fraction=0.6, val_fraction=0.5)


def test_count_split(tiny_scene):
    split = make_split(tiny_scene.gt, "count", train_per_class=5, val_per_class=3, seed=0)
    counts = split.counts(tiny_scene.gt)
    assert set(counts["train"].values()) == {5} and set(counts["val"].values()) == {3}
    assert len(split.train) + len(split.val) + len(split.test) == int((tiny_scene.gt > 0).sum())
    with pytest.raises(DataError, match="too few"):
        make_split(tiny_scene.gt, "count", train_per_class=500)
    again = make_split(tiny_scene.gt, "count", train_per_class=5, val_per_class=3, seed=0)
    np.testing.assert_array_equal(again.train, split.train)


@pytest.mark.parametrize("patch_size", [1, 5, 9])
def test_disjoint_split_has_no_overlapping_patches(patch_size):
    scene = load_scene("synthetic_indian_pines", seed=0)
    split = make_split(scene.gt, "disjoint", train_fraction=0.3, val_fraction=0.1, block_size=12,
                       patch_size=patch_size, seed=0)  # fmt: skip
    assert len(split.val) > 0 and len(split.test) > 0
    radius = patch_size // 2
    train_tree = cKDTree(split.train)
    for held_out in (split.val, split.test):
        gap, _ = train_tree.query(held_out, p=np.inf)  # Chebyshev distance to the nearest training centre
        assert gap.min() > 2 * radius  # windows of radius r around both centres never share a pixel
    assert min(split.counts(scene.gt)["train"].values()) >= 1


def test_disjoint_split_blocks_default_to_four_patches_and_the_audit_finds_no_overlap():
    scene = load_scene("synthetic_indian_pines", seed=0)
    split = make_split(scene.gt, "disjoint", train_fraction=0.3, val_fraction=0.1, patch_size=5, seed=0)
    assert split.options["block_size"] == 20 and split.patch_size == 5
    audit = audit_leakage(split, scene.gt.shape, 5)
    assert audit["overlapping_test_patches"] == 0 and audit["min_centre_distance"] > 4  # > 2r, r = 2
    assert audit_leakage(split, scene.gt.shape, 11)["overlapping_test_patches"] > 0  # a larger patch reaches over
    random = make_split(scene.gt, "stratified", train_fraction=0.3, val_fraction=0.1, seed=0)
    audit = audit_leakage(random, scene.gt.shape, 5)
    assert audit["min_centre_distance"] == 1.0  # a random pixel split puts test pixels next to training pixels
    assert audit["overlapping_test_patches"] > 0.9 * audit["test_patches"]
    with pytest.raises(DataError, match="block_size"):
        make_split(np.ones((4, 4), dtype=np.int64), "disjoint", train_fraction=0.5, block_size=-1)


def test_disjoint_blocks_too_large_for_the_scene_are_refused_with_a_size_that_fits():
    scene = load_scene("synthetic_indian_pines", seed=0)  # 145 × 145: 4 × patch 25 = 100-pixel blocks, 4 of them
    refused = r"blocks of 100 pixels \(the default, 4 × patch_size 25\) leaves 4 blocks"
    with pytest.raises(DataError, match=refused) as e:
        make_split(scene.gt, "disjoint", train_fraction=0.1, val_fraction=0.1, patch_size=25, seed=0)
    assert "data.block_size, e.g. 20" in str(e.value)
    split = make_split(scene.gt, "disjoint", train_fraction=0.1, val_fraction=0.1, patch_size=25, block_size=20)
    assert len(split.val) and len(split.test)  # a patch of 25 drops many near training blocks, but leaves some


def test_split_save_load_round_trip(tmp_path, tiny_scene):
    split = make_split(tiny_scene.gt, "stratified", train_fraction=0.2, val_fraction=0.2, patch_size=3, seed=7)
    split.save(tmp_path / "split.npz")
    loaded = Split.load(tmp_path / "split.npz")
    assert (loaded.kind, loaded.seed, loaded.patch_size) == ("stratified", 7, 3)
    assert loaded.protocol == split.protocol and loaded.options == {"train_fraction": 0.2, "val_fraction": 0.2}
    for a, b in zip(_as_sets(split), _as_sets(loaded), strict=True):
        assert a == b
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(DataError, match="not a split file"):
        Split.load(tmp_path / "bad.npz")
    with pytest.raises(DataError, match="Unknown split"):
        make_split(tiny_scene.gt, "random")


# ---------------------------------------------------------------------------------------------- padding and checks
def test_pad_reflect_and_its_errors():
    cube = np.arange(4 * 5 * 2, dtype=np.float32).reshape(4, 5, 2)
    padded = pad_reflect(cube, 5)
    assert padded.shape == (8, 9, 2)
    np.testing.assert_array_equal(padded[2:-2, 2:-2], cube)
    np.testing.assert_array_equal(padded[1, 2:-2], cube[1])  # reflection without repeating the edge
    with pytest.raises(DataError, match="odd"):
        pad_reflect(cube, 4)
    with pytest.raises(DataError, match="too large"):
        pad_reflect(cube, 9)


def test_check_finite_reports_count_and_first_location():
    cube = np.zeros((3, 4, 5), dtype=np.float32)
    check_finite(cube)
    cube[1, 2, 3] = np.nan
    cube[2, 0, 0] = np.inf
    with pytest.raises(DataError, match=r"2 NaN/Inf values, the first at \(row, col, band\) \(1, 2, 3\)"):
        check_finite(cube)


def test_check_labels():
    check_labels(np.array([[0, 1], [2, 3]]), 3)
    with pytest.raises(DataError, match=r"labels \[4\] outside 0..3"):
        check_labels(np.array([[0, 4], [2, 3]]), 3)
