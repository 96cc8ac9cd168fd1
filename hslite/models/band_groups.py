"""Contiguous band groups for channel-grouped models, aligned to spectral regions when band wavelengths are known.

Also what the task is handed to train band groups across ranks (channel groups) or a subset at a time (rotation).
"""

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from hslite.errors import ModelError

# Reflectance regions as (name, low_nm, high_nm), each half-open [low, high). The edges are the usual remote-sensing
# convention (Lillesand, Kiefer and Chipman, "Remote Sensing and Image Interpretation", ch. 1, spectral reflectance of
# vegetation): pigments absorb below 700 nm, leaf structure makes the 700-1300 nm plateau, and past 1300 nm the water
# absorption bands near 1400 and 1900 nm dominate; the 1900 nm band also separates Landsat 8's SWIR-1 (1570-1650 nm)
# and SWIR-2 (2110-2290 nm) bands. Sensors see those water bands as noisy or dropped, so a group that stops at these
# edges does not mix the bands on either side of a gap. The outer regions are open-ended so that every band has one.
SPECTRAL_REGIONS_NM: tuple[tuple[str, float, float], ...] = (
    ("VIS", -math.inf, 700.0),
    ("NIR", 700.0, 1300.0),
    ("SWIR-1", 1300.0, 1900.0),
    ("SWIR-2", 1900.0, math.inf),
)


def contiguous_band_groups(num_bands: int, num_groups: int) -> list[tuple[int, int]]:
    """Split bands 0..num_bands into num_groups contiguous (start, stop) ranges whose sizes differ by at most one.

    The larger ranges come first: 10 bands in 4 groups give sizes 3, 3, 2, 2.
    """
    base, extra = divmod(num_bands, num_groups)
    groups, start = [], 0
    for index in range(num_groups):
        stop = start + base + (index < extra)
        groups.append((start, stop))
        start = stop
    return groups


def spectral_band_groups(
    wavelengths_nm: Sequence[float] | np.ndarray | None, num_bands: int, num_groups: int
) -> list[tuple[int, int]]:
    """Split bands 0..num_bands into num_groups contiguous (start, stop) ranges that follow SPECTRAL_REGIONS_NM.

    Without wavelengths this is ``contiguous_band_groups``. With them, each non-empty region gets at least one group
    when there are enough groups, the spare groups go to regions in proportion to their band counts (largest
    remainder, never more groups than bands, ties to the earlier region) and each region is split evenly, so every
    group lies within one region. With fewer groups than non-empty regions, the adjacent pair of regions with the
    fewest bands together is merged (ties to the earlier pair) until one span per group is left.

    >>> spectral_band_groups(np.linspace(400, 2500, 200), 200, 4)  # evenly spaced stand-in for AVIRIS Indian Pines
    [(0, 29), (29, 86), (86, 143), (143, 200)]

    Sensors built from several spectrometers overlap at their seams (AVIRIS: band 31 at 686.9 nm follows band 30
    at 696.5 nm), so wavelengths need not increase everywhere: a band belongs to the region of the longest
    wavelength up to it, which keeps every region one contiguous run of bands.

    Raises ModelError when num_groups is not between 1 and num_bands, or the wavelengths are not one finite value
    per band.
    """
    if not 1 <= num_groups <= num_bands:
        raise ModelError(
            f"num_groups must be between 1 and the number of bands ({num_bands}); got {num_groups}. "
            f"Pass num_groups={min(max(num_groups, 1), max(num_bands, 1))} or another value in that range."
        )
    if wavelengths_nm is None:
        return contiguous_band_groups(num_bands, num_groups)
    wavelengths = _checked_wavelengths_nm(wavelengths_nm, num_bands)

    region_edges_nm = [high for _, _, high in SPECTRAL_REGIONS_NM[:-1]]
    region_of_band = np.searchsorted(region_edges_nm, np.maximum.accumulate(wavelengths), side="right")
    run_starts = [0, *(np.flatnonzero(np.diff(region_of_band)) + 1).tolist()]
    regions = list(zip(run_starts, [*run_starts[1:], num_bands], strict=True))

    if num_groups < len(regions):
        return _merged_regions(regions, num_groups)
    groups: list[tuple[int, int]] = []
    counts = _groups_per_region([stop - start for start, stop in regions], num_groups)
    for (start, stop), count in zip(regions, counts, strict=True):
        groups.extend((start + low, start + high) for low, high in contiguous_band_groups(stop - start, count))
    return groups


def _checked_wavelengths_nm(wavelengths_nm: Sequence[float] | np.ndarray, num_bands: int) -> np.ndarray:
    """The wavelengths as a float array, after checking there is one finite value per band."""
    wavelengths = np.asarray(wavelengths_nm, dtype=np.float64)
    if wavelengths.shape != (num_bands,):
        raise ModelError(
            f"Expected one wavelength per band ({num_bands}); got an array of shape {wavelengths.shape}. "
            "Pass the band centre wavelengths in nm, in band order, or None to split the bands evenly."
        )
    not_finite = np.flatnonzero(~np.isfinite(wavelengths))
    if not_finite.size:
        band = int(not_finite[0])
        raise ModelError(
            f"The wavelength of band {band} is {wavelengths[band]}; every wavelength must be a finite number of nm. "
            "Fill in the missing wavelengths, or pass None to split the bands evenly."
        )
    return wavelengths


def _groups_per_region(region_sizes: list[int], num_groups: int) -> list[int]:
    """One group per region, then the spare groups by largest remainder of their share of the bands, capped."""
    total_bands = sum(region_sizes)
    spare = num_groups - len(region_sizes)
    extra = [0] * len(region_sizes)
    for _ in range(spare):
        # Handing out one group at a time to the region furthest below its quota spare * size / total is the
        # largest-remainder method, and it respects the cap. Scaled by total_bands so ties compare exactly; max()
        # keeps the first of equal keys, i.e. the earlier region. Some region always has room: sum(size - 1) is
        # num_bands - regions >= num_groups - regions.
        open_regions = [index for index, size in enumerate(region_sizes) if 1 + extra[index] < size]
        chosen = max(open_regions, key=lambda index: spare * region_sizes[index] - extra[index] * total_bands)
        extra[chosen] += 1
    return [1 + count for count in extra]


def _merged_regions(regions: list[tuple[int, int]], num_groups: int) -> list[tuple[int, int]]:
    """Merge the adjacent spans with the fewest bands together (earlier pair on ties) until num_groups remain."""
    spans = list(regions)
    while len(spans) > num_groups:
        pair_sizes = [spans[index + 1][1] - spans[index][0] for index in range(len(spans) - 1)]
        index = pair_sizes.index(min(pair_sizes))
        spans[index : index + 2] = [(spans[index][0], spans[index + 1][1])]
    return spans


class GroupedForward(Protocol):
    """What a channel-group strategy hands the task on each rank (`parallel.channel_groups.ChannelGroups`).

    Declared here, not imported, so the task does not depend on `parallel/`: strategies depend on the task.
    """

    def __call__(self, model: nn.Module, x: torch.Tensor, active: Sequence[int] | None = None) -> torch.Tensor:
        """Logits of this rank's samples, its band groups encoded here and the others' exchanged."""

    def own_samples(self, batch: torch.Tensor) -> torch.Tensor:
        """The slice of a batch whose logits this rank computes."""

    def loss_share(self, loss: nn.CrossEntropyLoss, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The share of the batch's loss this rank computes, scaled so DDP's average is the whole batch's."""


class BandRotation(Protocol):
    """Channel-subset rotation of the training steps (`parallel.rotation.RotationSchedule`)."""

    def active_groups(self, step: int) -> list[int]:
        """The band groups optimiser step `step` trains."""

    def forward(self, model: nn.Module, x: torch.Tensor, active: Sequence[int]) -> torch.Tensor:
        """Logits with only the `active` band groups encoded."""

    def evaluate(self, model: nn.Module, x: torch.Tensor, grouped: GroupedForward | None = None) -> torch.Tensor:
        """Evaluation logits of a model trained under rotation: the ensemble of the subsets training drew."""
