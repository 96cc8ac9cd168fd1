"""Batch buffers are reused only once nothing can read them, and never inside DataLoader workers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hslite.datasets.batches.batch_buffers import BufferPool
from hslite.datasets.batches.patches import PatchGatherer
from hslite.datasets.preprocess import pad_reflect


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_free_buffer_is_reused_and_a_held_one_never_is():
    pool = BufferPool(capacity=4)
    first = pool.empty((2, 3))
    address = _address(first)
    assert _address(pool.empty((2, 3))) != address  # `first` is alive
    view = first[:, 1]
    del first
    assert _address(pool.empty((2, 3))) != address  # a view keeps the storage
    del view
    assert _address(pool.empty((2, 3))) == address  # nothing references it any more
    assert _address(pool.empty((3, 2))) != address  # another shape never shares


def test_autograd_and_numpy_views_keep_a_buffer_busy():
    pool = BufferPool()
    x = pool.empty((4,)).fill_(1.0)
    address = _address(x)
    weight = torch.ones(4, requires_grad=True)
    loss = (x * weight).sum()  # autograd saves x for the weight's gradient
    as_numpy = x.numpy()
    del x
    assert _address(pool.empty((4,))) != address
    del as_numpy
    assert _address(pool.empty((4,))) != address
    loss.backward()
    del loss
    assert _address(pool.empty((4,))) == address


def test_capacity_forgets_the_oldest_without_freeing_it_under_a_user():
    pool = BufferPool(capacity=2)
    held = [pool.empty((5,)).fill_(float(i)) for i in range(3)]  # the third pushes the first out of the pool
    assert [t[0].item() for t in held] == [0.0, 1.0, 2.0]
    assert len(pool._arrays) == 2 and all(_address(pool.empty((5,))) != _address(t) for t in held)


def test_a_copy_of_the_pool_starts_empty():
    pool = BufferPool()
    kept = pool.empty((3,))
    assert pickle.loads(pickle.dumps(pool))._arrays == [] and kept.shape == (3,)


class _Batches(Dataset):
    def __init__(self):
        self.pool = BufferPool()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.pool.empty((2,)).fill_(float(i))


def test_workers_allocate_plainly_and_batches_stay_intact(monkeypatch):
    pool = BufferPool()
    monkeypatch.setattr("hslite.datasets.batches.batch_buffers.get_worker_info", lambda: object())
    pool.empty((2,))
    assert pool._arrays == []
    monkeypatch.undo()
    loader = DataLoader(_Batches(), batch_size=None, num_workers=1, multiprocessing_context="spawn")
    batches = list(loader)
    assert [b.tolist() for b in batches] == [[float(i)] * 2 for i in range(4)]


def test_gathered_batches_held_by_the_caller_are_never_overwritten():
    rng = np.random.default_rng(0)
    gatherer = PatchGatherer(pad_reflect(rng.normal(size=(6, 7, 3)).astype(np.float32), 3), 3)
    coords = [torch.tensor([[i % 6, i % 7]]) for i in range(8)]
    kept = [gatherer.gather(c) for c in coords]
    again = [gatherer.gather(c) for c in coords]
    assert all(torch.equal(a, b) for a, b in zip(kept, again, strict=True))
    assert len({_address(t) for t in kept + again}) == 16


def test_a_pinning_pool_takes_each_batch_from_torchs_page_locked_allocator(monkeypatch):
    # torch's allocator keeps a freed block from reuse until the asynchronous copies that read it have run (CUDA
    # events); a pool of its own arrays could not tell (test_pinned_batches_are_not_reused_under_a_copy, on a GPU).
    requests = []

    def empty(*shape, **kwargs):
        requests.append(kwargs)
        return torch.zeros(*shape)

    pool = BufferPool(pin_memory=True)
    monkeypatch.setattr(torch, "empty", empty)
    pool.empty((2, 3))
    pool.empty((2, 3))
    monkeypatch.setattr("hslite.datasets.batches.batch_buffers.get_worker_info", lambda: object())
    pool.empty((2, 3))  # in a worker: plain memory; the DataLoader pins the batch on arrival
    monkeypatch.undo()
    assert requests == [{"pin_memory": True}, {"pin_memory": True}, {}] and pool._arrays == []
    assert pickle.loads(pickle.dumps(pool)).pin_memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: page-locked memory and CUDA events")
def test_pinned_batches_are_not_reused_under_a_copy():
    pool = BufferPool(pin_memory=True)
    size = 1 << 22
    torch.cuda._sleep(200_000_000)  # keeps the stream busy for ~0.1 s: the copy below runs after it
    batch = pool.empty((size,)).fill_(1.0)
    on_device = batch.to("cuda", non_blocking=True)
    del batch  # freed while the copy is still queued
    again = pool.empty((size,)).fill_(2.0)  # must not be the block the queued copy reads
    assert bool((on_device == 1.0).all()) and again.is_pinned()
