"""What a device-resident or page-locked gather hands on: a placed gatherer pickles its host cube (a spawned rank
places it on its own GPU), the probe leaves the datamodule's gatherer on the host, and an augmented batch is written
straight into page-locked memory, so the DataLoader does not copy it again.

No GPU here: "meta" stands for the GPU a cube is placed on, and page-locked allocations are recorded, not made.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory

from hslite.datasets.batches.patches import PatchDataset, PatchGatherer
from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.preprocess import pad_reflect
from hslite.datasets.settings import DataSettings
from hslite.recipe.recipe_parts import training_batches


@pytest.fixture(scope="module")
def padded() -> np.ndarray:
    rng = np.random.default_rng(38)
    return pad_reflect(rng.normal(size=(11, 13, 6)).astype(np.float32), 5)


def _coords(n: int = 20) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).integers(0, [11, 13], size=(n, 2)))


def test_a_placed_gatherer_pickles_its_host_cube_and_is_placed_again_where_it_is_unpickled(padded):
    coords = _coords()
    gatherer = PatchGatherer(padded, 5, device="meta", use_kernel=False)
    host_cube = gatherer.storage
    gatherer.gather(coords)  # placed, as the launcher's probe places the datamodule's gatherer on its GPU
    assert gatherer.storage.device.type == "meta"
    rank = pickle.loads(pickle.dumps(gatherer))
    # Spawned, a device copy would travel as a handle to the launcher's GPU, and every rank would gather there.
    assert rank.storage.device.type == "cpu" and rank.row_offsets.device.type == "cpu"
    assert torch.equal(rank.storage, host_cube) and rank.device == torch.device("meta")
    assert rank.gather(coords).device.type == "meta" and rank.storage.device.type == "meta"  # placed anew, there
    again = pickle.loads(pickle.dumps(rank))
    again.device = torch.device("cpu")  # a rank whose own device is the host: the cube's values are there to compare
    assert torch.equal(again.gather(coords), PatchGatherer(padded, 5, use_kernel=False).gather(coords))


def test_the_probes_batches_leave_the_datamodules_gatherer_on_the_host():
    module = HSIDataModule(DataSettings("synthetic_tiny", patch_size=3, augment=True), gather_device="cpu")
    module.setup("fit")
    shared = module.train_dataloader().dataset.gatherer
    shared.device = torch.device("meta")  # stands for "cuda": the cube moves there at the first gather
    x, y = training_batches(module, seed=0)(4)
    assert x.device.type == "meta" and x.shape[0] == len(y) == 4  # the probe gathered on the device
    assert shared.storage.device.type == "cpu"  # what the spawned ranks get: no copy of the cube on the probed GPU


def test_a_spawned_rank_gets_the_datamodules_settings_and_no_gatherer():
    module = HSIDataModule(DataSettings("synthetic_tiny", patch_size=3), gather_device="cpu")
    module.setup("fit")
    shipped = pickle.loads(pickle.dumps(module))  # what spawn sends each rank: setup() rebuilds the gatherer there
    assert shipped._gatherer is None and shipped.settings == module.settings


@pytest.fixture
def page_locked(monkeypatch):
    """Addresses of the blocks asked for page-locked, and the copies `Tensor.pin_memory` makes of any other tensor."""
    record = {"pinned": set(), "copied": []}
    plain_empty, plain_pin = torch.empty, torch.Tensor.pin_memory

    def empty(*args, pin_memory=False, **kwargs):
        tensor = plain_empty(*args, **kwargs)
        if pin_memory:
            record["pinned"].add(tensor.data_ptr())
        return tensor

    def pin(tensor, *args, **kwargs):
        if tensor.data_ptr() in record["pinned"]:
            return tensor  # torch returns a page-locked tensor as it is
        record["copied"].append(tuple(tensor.shape))
        return plain_pin(tensor, *args, **kwargs) if torch.cuda.is_available() else tensor.clone()

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return record


@pytest.mark.parametrize("channels_last", [False, True])
def test_an_augmented_batch_is_written_into_page_locked_memory_and_not_copied_again(padded, page_locked, channels_last):
    coords = _coords(32)
    gatherer = PatchGatherer(padded, 5, channels_last=channels_last, pin_memory=True)
    dataset = PatchDataset(gatherer, coords.numpy(), np.arange(32) % 4, augment=True, seed=1)
    batch = dataset.__getitems__(list(range(32)))
    assert batch[0].data_ptr() in page_locked["pinned"]
    x, _ = pin_memory(batch)  # what the DataLoader's pin_memory=True does
    assert x is batch[0] and page_locked["copied"] == [(32,)]  # the labels alone: the patches go in their one copy
    plain = PatchGatherer(padded, 5, channels_last=channels_last).gather(coords)
    assert torch.equal(x.flatten(2).sort(dim=2).values, plain.flatten(2).sort(dim=2).values)  # flipped, not changed
    assert not torch.equal(x, plain) and x.is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
