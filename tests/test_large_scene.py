"""A scene as large as a flightline: read by blocks, one float32 copy of what training needs, refused up front when
even that does not fit the memory budget given (data.host_memory_gb), trained and mapped within it when it does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import fixtures_data as fx
import numpy as np
import pytest
import torch

from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.preprocess import BandNormalizer, PCAReducer, pad_reflect, preprocess_block
from hslite.datasets.scene_input import padded_input, training_spectra
from hslite.datasets.scenes.io import open_cube
from hslite.datasets.scenes.synthetic import write_large_scene
from hslite.datasets.settings import DataSettings
from hslite.errors import ConfigError, DataError
from hslite.recipe.build import plan_from_config, prepared_datamodule
from hslite.recipe.config import load_config
from hslite.recipe.memory_check import resident_bytes

GB = 1e9


@pytest.fixture
def npy_cube(tmp_path):
    cube = fx.tiny_cube(23, 17, 9).astype(np.float32)
    np.save(tmp_path / "cube.npy", cube)
    return tmp_path / "cube.npy", cube


@pytest.mark.parametrize("bands_first", [False, True])
def test_the_input_filled_block_by_block_is_the_whole_cube_preprocessed_and_padded(npy_cube, bands_first):
    path, cube = npy_cube
    kept = np.array([0, 2, 3, 5, 8])
    normaliser = BandNormalizer("zscore").fit(cube[::3, ::2, kept].reshape(-1, kept.size))
    pca = PCAReducer(3).fit(normaliser.transform(cube[::2, ::3, kept].reshape(-1, kept.size)))
    whole = pad_reflect(preprocess_block(cube, kept, normaliser, pca), 5)

    def transform(block, first_row):
        return preprocess_block(block, kept, normaliser, pca, first_row)

    # 3 rows a block: blocks that do not divide the scene, and a patch radius that reaches over two blocks
    built = padded_input(open_cube(path), transform, 3, 5, bands_first, block_bytes=3 * 17 * 9 * 4)
    np.testing.assert_allclose(built.transpose(1, 2, 0) if bands_first else built, whole, rtol=1e-6, atol=1e-6)


def test_training_spectra_are_read_by_blocks_and_a_nan_is_placed_in_the_scene(npy_cube, tmp_path):
    path, cube = npy_cube
    coords = np.array([[22, 16], [0, 0], [11, 3], [4, 9], [11, 4]])
    kept = np.array([1, 4, 6])
    spectra = training_spectra(open_cube(path), kept, coords, block_bytes=2 * 17 * 9 * 4)
    np.testing.assert_array_equal(spectra, cube[coords[:, 0], coords[:, 1]][:, kept])
    cube[13, 2, 4] = np.nan
    np.save(tmp_path / "nan.npy", cube)
    with pytest.raises(DataError, match=r"\(13, 2, 1\)"):  # band 1 of the kept bands; row 13 of the scene
        training_spectra(open_cube(tmp_path / "nan.npy"), kept, coords, block_bytes=2 * 17 * 9 * 4)


def test_a_memory_mapped_cube_read_by_blocks_keeps_one_block_resident(tmp_path):
    rows, cols, bands = 400, 250, 100  # 40 MB
    np.save(tmp_path / "cube.npy", np.ones((rows, cols, bands), dtype=np.float32))
    cube = open_cube(tmp_path / "cube.npy")
    before = resident_bytes()
    total = sum(float(block[-1, -1, -1]) for _, block in cube.blocks(block_bytes=2 * 2**20))
    assert total == pytest.approx(cube.shape[0] / cube.block_rows(2 * 2**20), abs=1)
    assert resident_bytes() - before < 0.25 * 4 * rows * cols * bands  # the mapped pages were handed back


def test_on_disk_trains_on_the_same_patches_and_maps_the_same_scene(tmp_path):
    write_large_scene(tmp_path / "cube.npy", tmp_path / "gt.npy", (150, 120, 12), labelled_fraction=0.1)
    kwargs = {"labels": str(tmp_path / "gt.npy"), "pca_components": 4, "patch_size": 5, "eval_batch_size": 997}
    kwargs.update(train_fraction=0.3, val_fraction=0.2)
    held, on_disk = (
        HSIDataModule(DataSettings(str(tmp_path / "cube.npy"), **kwargs, on_disk=flag)) for flag in (False, True)
    )  # fmt: skip
    for module in (held, on_disk):
        module.setup("fit")
    for name in ("train", "val", "test"):
        everything = list(range(len(held._datasets[name])))
        pair = (module._datasets[name].__getitems__(everything) for module in (held, on_disk))
        for a, b in zip(*pair, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)
    tiles = list(on_disk.predict_dataloader())
    assert len(tiles) == len(on_disk.predict_dataloader())
    mapped = [torch.cat(parts) for parts in zip(*tiles, strict=True)]
    whole = [torch.cat(parts) for parts in zip(*held.predict_dataloader(), strict=True)]
    for a, b in zip(whole, mapped, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)
    labelled = int((np.load(tmp_path / "gt.npy") > 0).sum())
    assert on_disk._gatherer.storage.numel() == labelled * 5 * 5 * 4  # the labelled pixels' patches, not the scene


def test_the_preflight_times_the_data_path_training_runs(tmp_path):
    # data.on_disk: the probe's batches are the patch bank's, as training's are, and the probe's record says so
    from hslite.recipe.recipe_parts import RecipeParts

    write_large_scene(tmp_path / "cube.npy", tmp_path / "gt.npy", (150, 120, 12), labelled_fraction=0.1)
    keys = {}
    for on_disk in (False, True):
        cfg = _own_scene_config(tmp_path, "data.pca_components=4", "data.patch_size=5", f"data.on_disk={on_disk}")
        datamodule = prepared_datamodule(cfg)
        parts = RecipeParts.of(cfg, plan_from_config(cfg), datamodule, 2, None, True)
        trained = datamodule.train_dataloader().dataset
        probed = trained.with_own_augmentation(cfg.train.seed)
        index = torch.randint(0, len(trained), (16,), generator=torch.Generator().manual_seed(cfg.train.seed))
        for a, b in zip(parts.make_batch(16), probed.__getitems__(index.tolist()), strict=True):
            assert torch.equal(a, b)
        keys[on_disk] = parts.cache_key
    assert "-image150x120-cpu" in keys[False] and "-bank150x120-cpu" in keys[True]  # a probe of one is not the other's


def _own_scene_config(tmp_path: Path, *overrides: str):
    return load_config(
        "quickstart",
        [
            f"data.scene={tmp_path / 'cube.npy'}", f"data.labels={tmp_path / 'gt.npy'}", f"output.root={tmp_path}",
            *overrides,
        ],
    )  # fmt: skip


def test_a_scene_larger_than_the_budget_is_refused_up_front_with_the_settings_that_fit(tmp_path):
    write_large_scene(tmp_path / "cube.npy", tmp_path / "gt.npy", (300, 200, 120))
    budget_gb = (resident_bytes() + 0.3 * GB) / GB  # what this process holds, plus less than the run needs
    cfg = _own_scene_config(tmp_path, "data.pca_components=0", "data.patch_size=3", f"data.host_memory_gb={budget_gb}")
    with pytest.raises(ConfigError) as refused:
        prepared_datamodule(cfg)
    sentence = str(refused.value)
    assert sentence.count(". ") == 0 and sentence.endswith(".")  # one sentence
    assert "(300×200×120, 0.03 GB as float32)" in sentence and f"data.host_memory_gb={budget_gb:g}" in sentence
    assert "data.pca_components=" not in sentence or "more memory" in sentence
    assert not list(tmp_path.glob("quickstart*"))  # refused before any run folder


def test_a_budget_that_fits_a_few_components_names_them(tmp_path):
    write_large_scene(tmp_path / "cube.npy", tmp_path / "gt.npy", (2000, 1000, 60))  # 0.48 GB, never read here
    budget_gb = (resident_bytes() + 0.75 * GB) / GB
    cfg = _own_scene_config(tmp_path, "data.pca_components=0", "data.patch_size=1", f"data.host_memory_gb={budget_gb}")
    with pytest.raises(ConfigError, match=r"set data\.pca_components=\d+ \(or at most \d+ bands kept"):
        prepared_datamodule(cfg)


@pytest.mark.slow
def test_a_cube_larger_than_the_budget_is_trained_and_mapped_within_it(tmp_path):
    # 1.4 GB as float32: its 0.95 leaves the check's estimate (interpreter, torch and Lightning 0.45-0.51 GB, blocks,
    # map, run allowance: about 1.07 GB) room on a fresh CI environment as on a warm one (1.1 GB was refused there)
    shape = (1400, 1000, 250)
    # Written by another process: a child's peak RSS starts from this one's peak, and writing maps the whole cube.
    write = f"from hslite.datasets.scenes.synthetic import write_large_scene as w; w({str(tmp_path)!r} + '/cube.npy', "
    subprocess.run([sys.executable, "-c", write + f"{str(tmp_path)!r} + '/gt.npy', {shape})"], check=True)
    cube_bytes = 4 * np.prod(shape)
    budget_bytes = int(0.95 * cube_bytes)
    command = [
        sys.executable, "-m", "hslite", "fit", f"data.scene={tmp_path / 'cube.npy'}",
        f"data.labels={tmp_path / 'gt.npy'}", "model.name=cnn1d", "data.patch_size=3", "data.pca_components=10",
        "train.max_epochs=1", "train.progress=false", f"output.root={tmp_path / 'runs'}",
        f"data.host_memory_gb={budget_bytes / GB}",
    ]  # fmt: skip
    rss = _peak_rss(command, tmp_path / "fit.log")
    assert rss <= budget_bytes, f"fit peaked at {rss / GB:.2f} GB, over the {budget_bytes / GB:.2f} GB budget"
    run = next((tmp_path / "runs").glob("*/*/metrics.json")).parent
    assert (run / "prediction.tif").is_file() and (run / "map.png").is_file()  # the whole scene was mapped
    predict = [sys.executable, "-m", "hslite", "predict", f"run={run}", f"cube={tmp_path / 'cube.npy'}"]
    assert _peak_rss([*predict, "progress=false"], tmp_path / "predict.log") <= budget_bytes


# Runs the command as its own child and prints that child's peak RSS. Measured from pytest directly, a child's peak
# starts at pytest's own: Linux folds the parent's high-water RSS into a vforked child's at exec (CI's pytest, after
# a thousand tests, made a 0.9 GB fit read 1.82 GB); this wrapper's own peak is an interpreter's.
_MEASURED = (
    "import os, subprocess, sys; child = subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], 'w'), "
    "stderr=subprocess.STDOUT); _, status, usage = os.wait4(child.pid, 0); "
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)"
)


def _peak_rss(command: list[str], log: Path) -> int:
    """Peak RSS of `command` in a process of its own; it must exit 0, or the test fails with its output."""
    measured = subprocess.run([sys.executable, "-c", _MEASURED, str(log), *command], capture_output=True, text=True)
    code, peak = (int(word) for word in measured.stdout.split())
    assert code == 0, log.read_text()[-3000:]
    return peak
