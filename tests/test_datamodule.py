"""HSIDataModule end to end on the synthetic tiny scene."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.settings import DataSettings
from hslite.datasets.splits import make_split
from hslite.errors import DataError


def _module(pin_memory: bool = False, gather_device: str | None = None, **overrides) -> HSIDataModule:
    options = dict(scene="synthetic_tiny", patch_size=5, batch_size=16, eval_batch_size=100, train_fraction=0.2)
    return HSIDataModule(DataSettings(**{**options, **overrides}), pin_memory=pin_memory, gather_device=gather_device)


def test_setup_loaders_and_predict_cover_the_scene():
    module = _module()
    module.prepare_data()
    module.setup("fit")
    datasets = dict(module._datasets)
    module.setup("test")  # idempotent: nothing rebuilt
    assert module._datasets == datasets
    assert module.num_bands == 32 and module.num_classes == 4 and len(module.class_names) == 4
    assert module.kept_bands.tolist() == list(range(32))
    split, gt = module.split, module.scene.gt
    train_batches = list(module.train_dataloader())
    assert sum(len(y) for _, y in train_batches) == len(split.train)
    x, y = train_batches[0]
    assert x.shape == (16, 32, 5, 5) and x.dtype == torch.float32 and y.min() >= 0 and y.max() <= 3
    for loader, coords in ((module.val_dataloader(), split.val), (module.test_dataloader(), split.test)):
        labels = torch.cat([y for _, y in loader])
        assert labels.tolist() == (gt[coords[:, 0], coords[:, 1]] - 1).tolist()
    predicted = list(module.predict_dataloader())
    assert [len(y) for _, y in predicted] == [100] * 5 + [76]  # eval_batch_size pixels a batch, the last one shorter
    assert torch.cat([y for _, y in predicted]).tolist() == (gt.reshape(-1) - 1).tolist()  # row-major, -1 unlabelled
    # normalisation was fitted on training pixels only: train pixels are standardised, at the centre of each patch
    centres = torch.cat([x[:, :, 2, 2] for x, _ in module._loader("train", 1000, shuffle=False)])
    np.testing.assert_allclose(centres.mean(0).numpy(), 0, atol=1e-4)


def test_band_removal_pca_and_split_file(tmp_path):
    module = _module(pca_components=4, remove_bands=[0, 1], remove_ranges_nm=[[2400, 2500]], normalisation="stretch2")
    module.setup()
    assert module.num_bands == 4 and module.pca is not None
    assert 0 not in module.kept_bands and module.wavelengths_nm.max() < 2400
    assert module.input_wavelengths_nm is None  # PCA components have no wavelength: band groups fall back to equal
    plain = _module(remove_bands=[0, 1])
    plain.setup()
    assert plain.input_wavelengths_nm.tolist() == plain.wavelengths_nm.tolist() and len(plain.wavelengths_nm) == 30
    assert next(iter(module.train_dataloader()))[0].shape[1] == 4
    split = make_split(module.scene.gt, "count", train_per_class=6, val_per_class=2, seed=5)
    split.save(tmp_path / "split.npz")
    reused = _module(split_file=str(tmp_path / "split.npz"))
    reused.setup()
    assert reused.split.kind == "count" and len(reused.split.train) == 24


def test_a_disjoint_split_reused_with_a_patch_that_overlaps_is_refused(tmp_path):
    drawn = _module(split="disjoint", patch_size=3, train_fraction=0.3)
    drawn.setup()
    assert drawn.leakage_audit()["overlapping_test_patches"] == 0
    drawn.split.save(tmp_path / "split.npz")
    _module(split_file=str(tmp_path / "split.npz"), patch_size=1).setup()  # a smaller patch stays disjoint
    with pytest.raises(DataError, match=r"drawn for patch_size=3; at data.patch_size=9 \d+ of its \d+ test patches"):
        _module(split_file=str(tmp_path / "split.npz"), patch_size=9).setup()


def test_errors_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="Unknown scene"):
        HSIDataModule(DataSettings(scene="nowhere"))
    module = _module()
    with pytest.raises(DataError, match="setup"):
        module.train_dataloader()
    with pytest.raises(DataError, match="setup"):
        _ = module.num_classes
    with pytest.raises(DataError, match="does not exist"):
        _module(split_file=str(tmp_path / "none.npz")).setup()
    with pytest.raises(DataError, match="too large"):
        _module(patch_size=49).setup()


def _batches(module: HSIDataModule, loader: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)  # the training sampler's order
    return list(getattr(module, f"{loader}_dataloader")())


@pytest.mark.parametrize("augment", [False, True])
def test_the_device_resident_gather_makes_the_host_path_batches(augment):
    host, resident = _module(augment=augment), _module(augment=augment, gather_device="cpu")
    host.setup()
    resident.setup()
    gatherer = resident._datasets["train"].gatherer
    assert not gatherer.native and gatherer.device.type == "cpu"  # the torch ops a GPU runs, not the C kernel
    for loader in ("train", "val", "predict"):
        for (x, y), (x_resident, y_resident) in zip(_batches(host, loader), _batches(resident, loader), strict=True):
            assert torch.equal(x, x_resident) and torch.equal(y, y_resident), loader


def test_pinning_is_for_cuda_and_the_gather_device_for_one_process(monkeypatch):
    pinned = _module(pin_memory=True)
    pinned.setup()
    with pytest.raises(DataError, match="pin_memory=True page-locks batches for copies to a CUDA device"):
        pinned.train_dataloader()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU box says; nothing is gathered here
    loader = pinned.train_dataloader()
    assert loader.pin_memory and loader.dataset.gatherer._buffers.pin_memory
    resident = _module(pin_memory=True, gather_device="cpu")  # batches are made on the device: nothing to pin
    resident.setup()
    assert not resident.train_dataloader().pin_memory and not resident._datasets["train"].gatherer._buffers.pin_memory
    with pytest.raises(DataError, match="num_workers=2 asks for DataLoader workers"):
        _module(gather_device="cuda", num_workers=2)
    for wrong in ("meta", "gpu"):
        with pytest.raises(DataError, match="gather_device must be None, 'cpu' or 'cuda"):
            _module(gather_device=wrong)
    on_cuda = _module(gather_device="cuda")
    on_cuda.setup()  # the cube stays on the host until the first gather
    assert on_cuda._datasets["train"].gatherer.storage.device.type == "cpu"
    monkeypatch.undo()
    with pytest.raises(DataError, match="gather_device='cuda' keeps the cube on a CUDA device, and torch sees none"):
        on_cuda.train_dataloader()


def test_a_gpu_recipe_pins_its_batches_or_gathers_on_the_device_as_it_asks(monkeypatch):
    from hslite.recipe.build import build_datamodule
    from hslite.recipe.config import load_config

    gpu = ["parallel.accelerator=gpu"]
    assert not build_datamodule(load_config("quickstart", gpu)).pin_memory  # no CUDA here: only priced, not run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    host = build_datamodule(load_config("quickstart", gpu))
    assert host.pin_memory and host.gather_device is None
    device = build_datamodule(load_config("quickstart", [*gpu, "data.gather_on_device=true"]))
    assert device.gather_device == "cuda"


def test_the_recipe_data_section_is_the_datamodule_settings_and_reaches_it_whole():
    """One definition: the recipe's `data` section is DataSettings plus what the run reads itself, passed on whole."""
    import dataclasses

    from hslite.recipe.build import build_datamodule
    from hslite.recipe.config import load_config
    from hslite.recipe.schema import DataConfig

    assert issubclass(DataConfig, DataSettings)
    own = {f.name for f in dataclasses.fields(DataConfig)} - {f.name for f in dataclasses.fields(DataSettings)}
    assert own == {"gather_on_device", "host_memory_gb"}
    overrides = ["data.patch_size=5", "data.block_size=12", "data.split=disjoint", "data.remove_bands=[0,3]",
                 "data.augment=true", "data.eval_batch_size=77", "data.host_memory_gb=3", "train.seed=4"]  # fmt: skip
    cfg = load_config("quickstart", overrides)
    datamodule = build_datamodule(cfg)
    expected = {f.name: getattr(cfg.data, f.name) for f in dataclasses.fields(DataSettings)}
    assert dataclasses.asdict(datamodule.settings) == expected
    assert type(datamodule.settings) is DataSettings and datamodule.seed == 4
    assert (expected["patch_size"], expected["block_size"], expected["remove_bands"]) == (5, 12, [0, 3])


def test_settings_out_of_their_range_are_one_sentence_and_the_hyperparameters_load_weights_only(tmp_path):
    with pytest.raises(DataError, match=r"HSIDataModule settings: patch_size=4 is out of range: must be an odd "
                                        r"number ≥ 1\. train_fraction=1\.5 is out of range"):  # fmt: skip
        HSIDataModule(DataSettings(patch_size=4, train_fraction=1.5))
    module = _module(remove_bands=[1, 2])
    torch.save(dict(module.hparams), tmp_path / "hparams.pt")  # what a checkpoint keeps of the datamodule
    assert torch.load(tmp_path / "hparams.pt", weights_only=True) == {**dataclasses.asdict(module.settings), "seed": 0}


def test_a_lightning_predict_pass_over_the_scene_keeps_no_index_per_pixel():
    """Lightning records a batch sampler's index lists for a whole predict pass; the scene's loader has none to keep."""
    import lightning.pytorch as pl

    from hslite.models import get_model
    from hslite.parallel.plan import Plan
    from hslite.run.evaluate import _predict
    from hslite.task import HSIClassifier

    module = _module()
    module.setup()
    loader = module.predict_dataloader()
    assert loader.batch_size is None and loader.batch_sampler is None
    task = HSIClassifier(get_model("cnn1d", in_bands=32, num_classes=4, patch_size=5), num_classes=4).eval()
    plan = Plan(accelerator="cpu", devices=1)
    predicted = _predict(plan, task, loader, 24 * 24)
    with torch.no_grad():
        expected = torch.cat([task(x).argmax(1) for x, _ in loader])
    assert predicted.tolist() == expected.tolist()
    assert _predict(plan, task, loader, 24 * 24, limit_predict_batches=2).tolist() == expected[:200].tolist()
    tracked = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    tracked.predict(task, dataloaders=loader)
    assert tracked.predict_dataloaders.batch_sampler is None  # so Lightning wrapped none to record its index lists
