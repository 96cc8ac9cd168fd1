"""Vectorised patch gathering equals naive slicing; augmentation; batches through a real DataLoader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hslite.datasets.patches import PatchDataset, PatchGatherer, augment_batch, collate_patches
from hslite.datasets.preprocess import pad_reflect
from hslite.errors import DataError


def _naive(padded: np.ndarray, coords: np.ndarray, p: int) -> torch.Tensor:
    """Reference: one slice + transpose per sample."""
    return torch.stack([torch.from_numpy(padded[r : r + p, c : c + p].transpose(2, 0, 1).copy()) for r, c in coords])


@pytest.fixture(scope="module")
def padded():
    rng = np.random.default_rng(0)
    return pad_reflect(rng.normal(size=(11, 13, 6)).astype(np.float32), 5)


def _all_coords(rows=11, cols=13):
    return np.stack(np.divmod(np.arange(rows * cols), cols), axis=1)


@pytest.mark.parametrize("channels_last", [False, True])
def test_gather_equals_naive_slicing(padded, channels_last):
    gatherer = PatchGatherer(padded, 5, channels_last=channels_last)
    coords = _all_coords()
    patches = gatherer.gather(torch.from_numpy(coords))
    assert patches.shape == (143, 6, 5, 5) and patches.dtype == torch.float32
    assert patches.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.equal(patches, _naive(padded, coords, 5))
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((3, 6, 5, 5), memory_format=memory_format)
    assert gatherer.gather(torch.tensor([[0, 0], [10, 12], [5, 7]]), out=out) is out
    assert torch.equal(out, _naive(padded, np.array([[0, 0], [10, 12], [5, 7]]), 5))


def test_gather_rejects_bad_sizes(padded):
    with pytest.raises(DataError, match="odd patch_size"):
        PatchGatherer(padded, 4)
    gatherer = PatchGatherer(padded, 5)
    with pytest.raises(DataError, match="shape"):
        gatherer.gather(torch.zeros((2, 2), dtype=torch.long), out=torch.empty(3, 6, 5, 5))
    with pytest.raises(DataError, match="outside the 11x13 image"):
        PatchDataset(gatherer, np.array([[11, 0]]), np.array([0]))


@pytest.mark.parametrize("channels_last", [False, True])
def test_augment_keeps_values_and_uses_all_eight_symmetries(padded, channels_last):
    x = PatchGatherer(padded, 5, channels_last=channels_last).gather(torch.from_numpy(_all_coords()))
    out = augment_batch(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    # each sample/band keeps its multiset of values
    assert torch.equal(x.flatten(2).sort(dim=2).values, out.flatten(2).sort(dim=2).values)
    symmetries = []
    for k in range(4):
        for flip in (False, True):
            t = torch.rot90(x, k, (2, 3))
            symmetries.append(t.flip(3) if flip else t)
    matched = [next(i for i, s in enumerate(symmetries) if torch.equal(s[j], out[j])) for j in range(len(x))]
    assert len(set(matched)) == 8  # every sample is one of the 8 symmetries, and all 8 occur


def test_getitems_through_a_real_dataloader_matches_naive(padded):
    coords = _all_coords()
    labels = np.arange(len(coords)) % 4
    dataset = PatchDataset(PatchGatherer(padded, 5), coords, labels)
    order = np.random.default_rng(0).permutation(len(coords)).tolist()
    loader = DataLoader(dataset, batch_size=32, sampler=order, collate_fn=collate_patches)
    batches = list(loader)
    assert [len(y) for _, y in batches] == [32, 32, 32, 32, 15]  # the last, partial batch is kept
    for k, (x, y) in enumerate(batches):
        chosen = order[32 * k : 32 * (k + 1)]
        assert torch.equal(x, _naive(padded, coords[chosen], 5))
        assert y.dtype == torch.int64 and y.tolist() == labels[chosen].tolist()
    x7, y7 = dataset[7]
    assert torch.equal(x7, _naive(padded, coords[[7]], 5)[0]) and int(y7) == labels[7]


def test_dataloader_with_workers_and_augmentation(padded):
    coords = _all_coords()
    dataset = PatchDataset(PatchGatherer(padded, 5), coords, np.zeros(len(coords)), augment=True, seed=3)
    loader = DataLoader(dataset, batch_size=50, num_workers=2, collate_fn=collate_patches)
    batches = [x for x, _ in loader]
    assert [len(b) for b in batches] == [50, 50, 43]
    plain = _naive(padded, coords, 5)
    augmented = torch.cat(batches)
    assert torch.equal(plain.flatten(2).sort(dim=2).values, augmented.flatten(2).sort(dim=2).values)
    assert not torch.equal(plain, augmented)
