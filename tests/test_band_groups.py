import math

import numpy as np
import pytest

from hslite.errors import ModelError
from hslite.models.band_groups import SPECTRAL_REGIONS_NM, contiguous_band_groups, spectral_band_groups
from hslite.parallel.channels.group_owners import rank_groups

# 4 VIS, 3 NIR, 2 SWIR-1 and 1 SWIR-2 bands: unequal region sizes, so allocation and merging are both exercised.
TEN_BANDS_NM = [420, 500, 580, 660, 750, 900, 1100, 1500, 1700, 2200]
REGION_EDGES_NM = [high for _, _, high in SPECTRAL_REGIONS_NM[:-1]]


def _region_of(wavelength_nm):
    return next(i for i, (_, low, high) in enumerate(SPECTRAL_REGIONS_NM) if low <= wavelength_nm < high)


def _region_runs(wavelengths_nm):
    """(start, stop) of each non-empty region, computed band by band, independently of the module."""
    regions = [_region_of(w) for w in wavelengths_nm]
    starts = [0] + [i for i in range(1, len(regions)) if regions[i] != regions[i - 1]]
    return list(zip(starts, starts[1:] + [len(regions)], strict=True))


def test_regions_tile_the_line_at_the_conventional_edges():
    assert [name for name, _, _ in SPECTRAL_REGIONS_NM] == ["VIS", "NIR", "SWIR-1", "SWIR-2"]
    assert REGION_EDGES_NM == [700.0, 1300.0, 1900.0]
    assert SPECTRAL_REGIONS_NM[0][1] == -math.inf and SPECTRAL_REGIONS_NM[-1][2] == math.inf
    for (_, _, high), (_, low, _) in zip(SPECTRAL_REGIONS_NM[:-1], SPECTRAL_REGIONS_NM[1:], strict=True):
        assert high == low


@pytest.mark.parametrize(
    ("num_groups", "expected"),
    [
        (4, [(0, 4), (4, 7), (7, 9), (9, 10)]),  # one group per region
        (5, [(0, 2), (2, 4), (4, 7), (7, 9), (9, 10)]),  # spare quotas 0.4, 0.3, 0.2, 0.1: VIS gets it
        (6, [(0, 2), (2, 4), (4, 6), (6, 7), (7, 9), (9, 10)]),  # quotas 0.8, 0.6, ...: VIS, then NIR
        (7, [(0, 2), (2, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10)]),  # quotas 1.2, 0.9, 0.6, 0.3
        (10, [(i, i + 1) for i in range(10)]),  # every region capped at one group per band
        (3, [(0, 4), (4, 7), (7, 10)]),  # SWIR-1 + SWIR-2 (3 bands) is the smallest pair
        (2, [(0, 4), (4, 10)]),  # then NIR + SWIR (6) beats VIS + NIR (7)
        (1, [(0, 10)]),
    ],
)
def test_ten_bands_across_all_four_regions(num_groups, expected):
    assert spectral_band_groups(TEN_BANDS_NM, 10, num_groups) == expected


def test_equal_bands_per_region_break_ties_towards_the_earlier_region():
    wavelengths = [450, 550, 650, 800, 1000, 1200, 1500, 1700, 2100, 2300]  # 3, 3, 2, 2 bands
    # Spare quotas 0.6, 0.6, 0.4, 0.4: VIS wins the tie with NIR for the first spare group, NIR gets the second.
    assert spectral_band_groups(wavelengths, 10, 6) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8), (8, 10)]
    assert spectral_band_groups(wavelengths, 10, 5) == [(0, 2), (2, 3), (3, 6), (6, 8), (8, 10)]
    # Pairs hold 6, 5 and 4 bands: SWIR-1 + SWIR-2 merge first, then VIS + NIR (6 bands, against 7).
    assert spectral_band_groups(wavelengths, 10, 2) == [(0, 6), (6, 10)]
    # Every adjacent pair holds 4 bands: the earlier pair merges.
    assert spectral_band_groups([600, 650, 800, 900, 1400, 1500, 2000, 2100], 8, 3) == [(0, 4), (4, 6), (6, 8)]


def test_a_region_never_gets_more_groups_than_bands():
    wavelengths = [650, 800, *np.linspace(1350, 1850, 8)]  # 1 VIS, 1 NIR, 8 SWIR-1 bands
    assert spectral_band_groups(wavelengths, 10, 9) == [(0, 1), (1, 2), (2, 4)] + [(i, i + 1) for i in range(4, 10)]


def test_band_on_an_edge_belongs_to_the_region_above():
    wavelengths = [699.9, 700.0, 1299.9, 1300.0, 1899.9, 1900.0]
    assert spectral_band_groups(wavelengths, 6, 4) == [(0, 1), (1, 3), (3, 5), (5, 6)]


def test_vnir_sensor_groups_only_vis_and_nir_split_at_700_nm():
    wavelengths = np.linspace(400, 1000, 61)  # 10 nm steps: bands 0-29 are VIS, 30-60 (700 nm on) NIR
    assert spectral_band_groups(wavelengths, 61, 4) == [(0, 15), (15, 30), (30, 46), (46, 61)]
    assert spectral_band_groups(wavelengths, 61, 1) == [(0, 61)]


def test_aviris_like_sensor_gets_one_group_per_region():
    # Evenly spaced stand-in for AVIRIS Indian Pines' 200 kept bands; also the docstring's example.
    wavelengths = np.linspace(400, 2500, 200)
    assert spectral_band_groups(wavelengths, 200, 4) == [(0, 29), (29, 86), (86, 143), (143, 200)]
    assert spectral_band_groups(wavelengths.tolist(), 200, 4) == spectral_band_groups(wavelengths, 200, 4)


@pytest.mark.parametrize(("num_bands", "num_groups"), [(10, 4), (200, 4), (103, 7), (7, 7), (5, 1), (30, 8)])
def test_without_wavelengths_falls_back_to_even_contiguous_groups(num_bands, num_groups):
    groups = spectral_band_groups(None, num_bands, num_groups)
    assert groups == contiguous_band_groups(num_bands, num_groups)
    sizes = [stop - start for start, stop in groups]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # larger groups first


def test_contiguous_band_groups_matches_the_channel_vit_split():
    assert contiguous_band_groups(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert contiguous_band_groups(200, 4) == [(0, 50), (50, 100), (100, 150), (150, 200)]
    assert contiguous_band_groups(5, 5) == [(i, i + 1) for i in range(5)]


def _random_sensor(rng):
    num_bands = int(rng.integers(1, 250))
    start_nm = rng.uniform(350, 2400)
    wavelengths = start_nm + np.cumsum(rng.uniform(0.5, 40, num_bands))  # positive steps: strictly increasing
    return wavelengths, num_bands


def test_random_sensors_give_covering_groups_that_respect_regions():
    """300 random sensors in one test (a few ms): one item, not 300, and the failing draw is named."""
    for seed in range(300):
        try:
            _check_random_sensor(seed)
        except AssertionError as err:
            raise AssertionError(f"random sensor of seed {seed}: {err}") from err


def _check_random_sensor(seed: int) -> None:
    rng = np.random.default_rng(seed)
    wavelengths, num_bands = _random_sensor(rng)
    # Half the draws keep G small so that merging (G below the number of regions) is exercised too.
    num_groups = int(rng.integers(1, (num_bands if seed % 2 else min(num_bands, 3)) + 1))
    groups = spectral_band_groups(wavelengths, num_bands, num_groups)

    assert len(groups) == num_groups
    assert groups[0][0] == 0 and groups[-1][1] == num_bands
    assert all(start < stop for start, stop in groups)
    assert all(a[1] == b[0] for a, b in zip(groups[:-1], groups[1:], strict=True))
    assert spectral_band_groups(wavelengths, num_bands, num_groups) == groups

    regions = _region_runs(wavelengths)
    region_bounds = {start for start, _ in regions} | {num_bands}
    group_bounds = {start for start, _ in groups} | {num_bands}
    if num_groups >= len(regions):
        assert region_bounds <= group_bounds  # no group straddles a region edge
        counts = [sum(r_start <= g_start < r_stop for g_start, _ in groups) for r_start, r_stop in regions]
        spare = num_groups - len(regions)
        sizes = [stop - start for start, stop in regions]
        for count, size in zip(counts, sizes, strict=True):
            assert 1 <= count <= size
            if all(s - 1 >= math.ceil(spare * s / num_bands) for s in sizes):  # no region capped
                assert abs(count - 1 - spare * size / num_bands) < 1  # largest remainder stays within one of quota
        for (r_start, r_stop), count in zip(regions, counts, strict=True):
            inside = [(a - r_start, b - r_start) for a, b in groups if r_start <= a < r_stop]
            assert inside == contiguous_band_groups(r_stop - r_start, count)
    else:
        assert group_bounds <= region_bounds  # each group is a run of whole regions


def test_overlapping_spectrometers_keep_regions_contiguous():
    # AVIRIS-like seams: bands a little out of order where spectrometers overlap, here across the 700 nm edge.
    wavelengths = [500, 600, 705, 695, 800, 900, 1250, 1310, 1295, 1500]
    assert spectral_band_groups(wavelengths, 10, 3) == [(0, 2), (2, 7), (7, 10)]


def test_the_indian_pines_table_groups_by_region():
    from hslite.datasets.scenes.wavelengths import INDIAN_PINES_220_NM

    groups = spectral_band_groups(INDIAN_PINES_220_NM, len(INDIAN_PINES_220_NM), 4)
    maxima = np.maximum.accumulate(INDIAN_PINES_220_NM)
    edges = [maxima[start] for start, _ in groups[1:]]
    assert len(groups) == 4 and [int(e >= edge) for e, edge in zip(edges, (700, 1300, 1900), strict=True)] == [1] * 3


@pytest.mark.parametrize(
    ("wavelengths", "num_bands", "num_groups", "message"),
    [
        ([400, 500, 600], 4, 2, r"one wavelength per band \(4\); got an array of shape \(3,\)"),
        ([[400, 500], [600, 700]], 4, 2, r"got an array of shape \(2, 2\)"),
        ([400, float("nan"), 600], 3, 2, r"wavelength of band 1 is nan; every wavelength must be a finite"),
        ([400, 500, float("inf")], 3, 2, r"wavelength of band 2 is inf"),
        ([400, 500, 600], 3, 0, r"num_groups must be between 1 and the number of bands \(3\); got 0"),
        ([400, 500, 600], 3, 4, r"between 1 and the number of bands \(3\); got 4"),
        (None, 3, 4, r"between 1 and the number of bands \(3\); got 4"),
        (None, 3, 0, r"got 0"),
    ],
)
def test_bad_input_raises_a_model_error_that_says_what_to_fix(wavelengths, num_bands, num_groups, message):
    with pytest.raises(ModelError, match=message):
        spectral_band_groups(wavelengths, num_bands, num_groups)


@pytest.mark.parametrize(
    ("sizes", "ranks", "most_bands"),
    [
        ([17, 16, 32, 32, 24, 23, 28, 28], 4, 52),  # Indian Pines in 8 region groups; consecutive pairs give 64
        ([33, 64, 47, 56], 2, 103),
        ([50] * 4, 4, 50),
        ([10] * 8, 2, 40),
        ([9, 1, 1, 1], 2, 10),
    ],
)
def test_channel_group_ranks_own_as_many_groups_with_their_bands_balanced(sizes, ranks, most_bands):
    owners = rank_groups(sizes, ranks)
    assert sorted(g for owned in owners for g in owned) == list(range(len(sizes)))  # every group once
    assert {len(owned) for owned in owners} == {len(sizes) // ranks}
    assert max(sum(sizes[g] for g in owned) for owned in owners) == most_bands
    assert rank_groups(sizes, ranks) == owners  # every rank derives the same split
