"""Vectorised patch gathering equals naive slicing; augmentation; pickling; batches through a real DataLoader."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hslite.datasets.batches.augment import augment_batch
from hslite.datasets.batches.patches import PatchDataset, PatchGatherer, _patchgather, collate_patches
from hslite.datasets.preprocess import pad_reflect
from hslite.errors import DataError


def _naive(padded: np.ndarray, coords: np.ndarray, p: int) -> torch.Tensor:
    """Reference: one slice + transpose per sample."""
    bands = padded.shape[2]
    if len(coords) == 0:
        return torch.empty((0, bands, p, p))
    return torch.stack([torch.from_numpy(padded[r : r + p, c : c + p].transpose(2, 0, 1).copy()) for r, c in coords])


def _padded(p: int, bands: int, rows: int = 11, cols: int = 13) -> np.ndarray:
    rng = np.random.default_rng(bands * 100 + p)
    return pad_reflect(rng.normal(size=(rows, cols, bands)).astype(np.float32), p)


@pytest.fixture(scope="module")
def padded():
    return _padded(5, 6)


def _all_coords(rows=11, cols=13):
    return np.stack(np.divmod(np.arange(rows * cols), cols), axis=1)


def _batch(n: int, seed: int = 0) -> np.ndarray:
    """n coordinates that start with the four corners and edge pixels, then random pixels (repeats allowed)."""
    edges = np.array([[0, 0], [0, 12], [10, 0], [10, 12], [0, 6], [10, 6], [5, 0], [5, 12]])
    rest = np.random.default_rng(seed).integers(0, [11, 13], size=(max(0, n - len(edges)), 2))
    return np.concatenate([edges, rest])[:n]


def _gatherer(padded: np.ndarray, p: int, path: str) -> PatchGatherer:
    """The C kernel, or the torch ops with the default chunk or chunks of 1 or 3 samples."""
    if path == "kernel":
        if _patchgather is None:
            pytest.skip("the C kernel is not built (no C compiler at install; test_kernel_is_built says if it should)")
        return PatchGatherer(padded, p)
    gatherer = PatchGatherer(padded, p, use_kernel=False)
    assert not gatherer.native
    if path != "torch":
        gatherer.samples_per_chunk = int(path.removeprefix("torch-chunk"))
    return gatherer


PATHS = ["kernel", "torch", "torch-chunk1", "torch-chunk3"]


@pytest.mark.parametrize("p", [1, 3, 9, 17])  # 17: the kernel's copy for sizes it does not unroll
@pytest.mark.parametrize("bands", [1, 2, 7, 33])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [0, 1, 5, 8, 37])  # 37 samples leave a short last chunk for chunks of 3 (and 7)
def test_gather_equals_naive_slicing(p, bands, path, n):
    padded = _padded(p, bands)
    coords = _batch(n)
    patches = _gatherer(padded, p, path).gather(torch.from_numpy(coords))
    assert patches.shape == (n, bands, p, p) and patches.dtype == torch.float32 and patches.is_contiguous()
    assert torch.equal(patches, _naive(padded, coords, p))


def test_kernel_is_built_where_a_compiler_exists():
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler here: the torch path gathers")
    assert _patchgather is not None, (
        "hslite.datasets.batches._patchgather was not built: reinstall with `pip install -e .`"
    )
    assert PatchGatherer(_padded(5, 3), 5).native


def test_kernel_refuses_what_it_cannot_read_safely(padded):
    if _patchgather is None:
        pytest.skip("the C kernel is not built")
    cube = torch.from_numpy(padded).permute(2, 0, 1).contiguous().numpy()
    out = np.full((2, 6, 5, 5), np.nan, np.float32)
    with pytest.raises(IndexError, match="patch 1 at"):  # checked before any copy: patch 0 is not written either
        _patchgather.gather(cube, np.array([[0, 0], [0, 13]]), out, 5)
    assert np.isnan(out).all()
    out = out[:1]
    with pytest.raises(IndexError, match=r"patch 0 at \(11, 0\) falls outside the 11x13 image"):
        _patchgather.gather(cube, np.array([[11, 0]]), out, 5)
    with pytest.raises(IndexError, match="outside"):
        _patchgather.gather(cube, np.array([[0, -1]]), out, 5)
    with pytest.raises(TypeError, match="coords"):
        _patchgather.gather(cube, np.array([[0, 0]], np.int32), out, 5)
    with pytest.raises(TypeError, match="cube"):
        _patchgather.gather(cube.astype(np.float64), np.array([[0, 0]]), out, 5)
    with pytest.raises(ValueError, match="out"):
        _patchgather.gather(cube, np.array([[0, 0]]), np.empty((1, 6, 3, 3), np.float32), 5)
    with pytest.raises(ValueError, match="not C-contiguous|contiguous"):
        _patchgather.gather(cube, np.array([[0, 0]]), np.empty((1, 6, 5, 10), np.float32)[..., ::2], 5)


@pytest.mark.parametrize("p", [1, 3, 9])
@pytest.mark.parametrize("bands", [1, 7])
def test_channels_last_gather_equals_naive_slicing(p, bands):
    padded = _padded(p, bands)
    coords = _batch(37)
    patches = PatchGatherer(padded, p, channels_last=True).gather(torch.from_numpy(coords))
    assert patches.shape == (37, bands, p, p) and patches.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(patches, _naive(padded, coords, p))


def test_gather_whole_image_and_default_chunk_boundaries(padded):
    gatherer = PatchGatherer(padded, 5, use_kernel=False)
    gatherer.samples_per_chunk = 7  # 143 pixels: 20 whole chunks and a short one
    coords = _all_coords()
    assert torch.equal(gatherer.gather(torch.from_numpy(coords)), _naive(padded, coords, 5))
    assert PatchGatherer(_padded(9, 200), 9).samples_per_chunk >= 2  # a few IP-sized samples per chunk


@pytest.mark.parametrize("channels_last, use_kernel", [(False, True), (False, False), (True, False)])
def test_gather_into_a_callers_buffer(padded, channels_last, use_kernel):
    gatherer = PatchGatherer(padded, 5, channels_last=channels_last, use_kernel=use_kernel)
    coords = np.array([[0, 0], [10, 12], [5, 7]])
    layout = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.full((3, 6, 5, 5), float("nan")).contiguous(memory_format=layout)
    assert gatherer.gather(torch.from_numpy(coords), out=out) is out
    assert torch.equal(out, _naive(padded, coords, 5))


@pytest.mark.parametrize("path", ["kernel", "torch-chunk2"])
def test_gather_into_a_slice_of_a_larger_buffer(padded, path):
    coords = np.array([[0, 0], [10, 12], [5, 7]])
    gatherer = _gatherer(padded, 5, path)
    big = torch.zeros((5, 6, 5, 5))
    gatherer.gather(torch.from_numpy(coords), out=big[1:4])
    assert torch.equal(big[1:4], _naive(padded, coords, 5))
    assert not big[0].any() and not big[4].any()


def test_gather_rejects_bad_sizes_and_buffers(padded):
    with pytest.raises(DataError, match="odd patch_size"):
        PatchGatherer(padded, 4)
    gatherer = PatchGatherer(padded, 5)
    two = torch.zeros((2, 2), dtype=torch.long)
    with pytest.raises(DataError, match="shape"):
        gatherer.gather(two, out=torch.empty(3, 6, 5, 5))
    with pytest.raises(DataError, match="float32"):
        gatherer.gather(two, out=torch.empty(2, 6, 5, 5, dtype=torch.float64))
    with pytest.raises(DataError, match="contiguous_format contiguous"):
        gatherer.gather(two, out=torch.empty(2, 6, 5, 5).contiguous(memory_format=torch.channels_last))
    with pytest.raises(DataError, match="channels_last contiguous"):
        PatchGatherer(padded, 5, channels_last=True).gather(two, out=torch.empty(2, 6, 5, 5))
    with pytest.raises(DataError, match="outside the 11x13 image"):
        PatchDataset(gatherer, np.array([[11, 0]]), np.array([0]))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_gatherer_pickles_without_its_view(padded, use_kernel):
    gatherer = PatchGatherer(padded, 5, use_kernel=use_kernel)
    coords = torch.from_numpy(_batch(20))
    before = gatherer.gather(coords)  # builds the overlapping runs view
    blob = pickle.dumps(gatherer)
    assert len(blob) < 2 * padded.nbytes  # the cube once, not the view's p*B-float rows
    copy = pickle.loads(blob)
    assert copy.samples_per_chunk == gatherer.samples_per_chunk and copy.native == gatherer.native
    assert torch.equal(copy.gather(coords), before)


@pytest.mark.parametrize("channels_last", [False, True])
def test_augment_keeps_values_and_uses_all_eight_symmetries(padded, channels_last):
    x = PatchGatherer(padded, 5, channels_last=channels_last).gather(torch.from_numpy(_all_coords()))
    out = augment_batch(x, torch.Generator().manual_seed(0))
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert out.shape == x.shape and out.is_contiguous(memory_format=layout)
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
    first, _ = batches[0]
    assert all(first.data_ptr() != x.data_ptr() for x, _ in batches[1:])  # a fresh tensor per batch


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


def test_a_host_tensor_goes_to_cuda_page_locked_and_without_waiting(monkeypatch):
    from hslite.datasets.batches.batch_buffers import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin_memory") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: calls.append((args, kwargs)) or self)
    to_device(torch.arange(3), torch.device("cuda", 0))
    assert calls == ["pin_memory", ((torch.device("cuda", 0),), {"non_blocking": True})]
    monkeypatch.undo()
    index = torch.arange(3)
    assert to_device(index, torch.device("cpu")) is index  # nothing to copy


def test_a_device_gatherer_holds_its_cube_on_the_host_until_it_gathers(padded):
    # A datamodule set up in a process that then spawns one rank per GPU must hold no device copy of the cube.
    gatherer = PatchGatherer(padded, 5, device="meta", use_kernel=False)  # a device with no memory to fill
    assert gatherer.storage.device.type == "cpu" and gatherer.row_offsets.device.type == "cpu"
    assert gatherer.place() == torch.device("meta")
    assert gatherer.storage.device.type == "meta" and gatherer.row_offsets.device.type == "meta"
