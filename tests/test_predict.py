"""`hslite predict`: a run's model and fitted preprocessing map its own scene and other cubes, block by block."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import fixtures_data as fx
import numpy as np
import pytest
import rasterio
import torch
from rasterio.errors import NotGeoreferencedWarning
from torch import nn

from hslite.cli import main
from hslite.datasets.batches.patches import PatchGatherer
from hslite.datasets.fitted import FittedPreprocessing
from hslite.datasets.preprocess import BandNormalizer, pad_reflect
from hslite.datasets.scenes.io import cube_from_array, read_mat
from hslite.datasets.scenes.registry import load_scene
from hslite.run.predict import PredictOptions, _map_blocks

CODES = np.array([0, 10, 20, 30, 40], dtype=np.uint8)  # synthetic_tiny's classes 1..4 written as the user's codes
FIT = ["model.name=cnn1d", "data.patch_size=1", "train.progress=false", "output.root=runs"]


def _read(path: Path) -> tuple[np.ndarray, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)  # the map of a cube without georeference
        with rasterio.open(path) as dataset:
            return dataset.read(), dataset.crs


def _only(folder: Path) -> Path:
    (found,) = folder.iterdir()
    return found


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """A cnn1d run (PCA on) over synthetic_tiny written as a georeferenced GeoTIFF cube and a .npy of codes 10..40."""
    folder = tmp_path_factory.mktemp("own")
    scene = load_scene("synthetic_tiny", seed=0)
    cube = (scene.cube * 1000).astype(np.int16)
    crs, _ = fx.write_geotiff_cube(folder / "cube.tif", cube)
    np.save(folder / "gt.npy", CODES[scene.gt])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        own = ["data.scene=cube.tif", "data.labels=gt.npy", "data.pca_components=8", "data.train_fraction=0.3"]
        quick = ["train.lr=0.01", "train.max_epochs=5", "data.batch_size=16", "preflight.enabled=false"]
        code = main(["fit", *own, *quick, *FIT])
    assert code == 0
    return {"run": _only(folder / "runs" / "quickstart"), "folder": folder, "cube": cube, "crs": crs}


def test_predict_maps_the_runs_scene_as_fit_did_into_a_new_folder(synthetic_run, capsys):
    run = synthetic_run["run"]
    before = (run / "prediction.tif").read_bytes()
    assert main(["predict", f"run={run}", "progress=false"]) == 0
    out = _only(run / "predict")
    assert f"wrote {out}" in capsys.readouterr().out
    expected, crs = _read(run / "prediction.tif")
    got, got_crs = _read(out / "prediction.tif")
    assert got.shape == (1, 24, 24) and got_crs == crs == synthetic_run["crs"]
    assert len(np.unique(expected)) > 1 and set(np.unique(expected)) <= set(CODES[1:])  # the user's codes, learnt
    np.testing.assert_array_equal(got, expected)
    assert (out / "map.png").is_file() and (out / "predict.json").is_file()
    assert (run / "prediction.tif").read_bytes() == before  # the run's own outputs are never touched


def test_probabilities_in_blocks_into_an_output_folder(synthetic_run, tmp_path):
    run = synthetic_run["run"]
    args = [f"run={run}", f"output={tmp_path}", "probabilities=true", "tile_rows=5", "batch_size=7", "progress=false"]
    assert main(["predict", *args]) == 0
    out = _only(tmp_path)
    probabilities, crs = _read(out / "probabilities.tif")
    labels, _ = _read(out / "prediction.tif")
    assert probabilities.shape == (4, 24, 24) and probabilities.dtype == np.float32 and crs == synthetic_run["crs"]
    np.testing.assert_allclose(probabilities.sum(axis=0), 1.0, atol=1e-5)
    np.testing.assert_array_equal(CODES[probabilities.argmax(axis=0) + 1], labels[0])
    np.testing.assert_array_equal(labels, _read(run / "prediction.tif")[0])


def test_the_runs_scene_from_a_file_without_georeference_keeps_the_runs(synthetic_run, tmp_path, capsys):
    cube, out = tmp_path / "same.npy", tmp_path / "out"
    np.save(cube, synthetic_run["cube"])
    assert main(["predict", f"run={synthetic_run['run']}", f"cube={cube}", f"output={out}"]) == 0
    labels, crs = _read(_only(out) / "prediction.tif")
    assert crs == synthetic_run["crs"] and "georeference: the run's scene's" in capsys.readouterr().out
    np.testing.assert_array_equal(labels, _read(synthetic_run["run"] / "prediction.tif")[0])
    other = synthetic_run["cube"].copy()
    other[0] += 1  # the same shape and bands, another flight line: the run's georeference would place it wrongly
    np.save(cube, other)
    assert main(["predict", f"run={synthetic_run['run']}", f"cube={cube}", f"output={out}"]) == 0
    assert "georeference: none (the cube has none, and its values" in capsys.readouterr().out
    assert _read(sorted(out.iterdir())[-1] / "prediction.tif")[1] is None  # the newer stamp


def test_a_cube_of_another_shape_is_not_compared_with_the_runs_scene(synthetic_run, tmp_path, capsys, monkeypatch):
    import hslite.run.predict as predict_module

    cube, out = tmp_path / "part.npy", tmp_path / "out"
    np.save(cube, synthetic_run["cube"][:20])
    monkeypatch.setattr(predict_module, "_run_scene", lambda prep: pytest.fail("the run's scene was loaded"))
    assert main(["predict", f"run={synthetic_run['run']}", f"cube={cube}", f"output={out}"]) == 0
    assert "georeference: none (the cube has none, and its shape (20, 24, " in capsys.readouterr().out


def test_wrong_band_count_missing_run_and_missing_checkpoint_are_one_sentence(synthetic_run, tmp_path, capsys):
    np.save(tmp_path / "short.npy", synthetic_run["cube"][:, :, :30])
    assert main(["predict", f"run={synthetic_run['run']}", f"cube={tmp_path / 'short.npy'}"]) == 1
    err = capsys.readouterr().err
    assert "short.npy has 30 bands but run" in err and "32-band cube" in err and "Traceback" not in err
    assert main(["predict", f"run={tmp_path / 'none'}"]) == 1
    assert "none does not exist; pass run=DIR" in capsys.readouterr().err
    ignore = shutil.ignore_patterns("checkpoints", "predict")
    bare = shutil.copytree(synthetic_run["run"], tmp_path / "bare", ignore=ignore)
    assert main(["predict", f"run={bare}"]) == 1
    err = capsys.readouterr().err
    assert "has no checkpoints/best.ckpt" in err and "Traceback" not in err
    assert main(["predict", f"run={bare}", "tiles=3"]) == 2
    assert "no option 'tiles'" in capsys.readouterr().err
    assert not (bare / "predict").exists()


def test_a_run_written_before_a_setting_existed_predicts_with_the_model_it_trained(synthetic_run, tmp_path):
    # a cnn1d run at 3x3 patches from before model.window_mean: its config.yaml lacks the key, and its convolution
    # reads the centre spectrum alone (one input channel), as the pixel run's weights do
    old = shutil.copytree(synthetic_run["run"], tmp_path / "old", ignore=shutil.ignore_patterns("predict"))
    config = (old / "config.yaml").read_text()
    assert "  patch_size: 1\n" in config and "  window_mean: false\n" in config
    (old / "config.yaml").write_text(
        config.replace("  patch_size: 1\n", "  patch_size: 3\n").replace("  window_mean: false\n", "")
    )
    assert main(["predict", f"run={old}", f"output={tmp_path / 'out'}", "progress=false"]) == 0
    labels, _ = _read(_only(tmp_path / "out") / "prediction.tif")
    np.testing.assert_array_equal(labels, _read(synthetic_run["run"] / "prediction.tif")[0])


class _PatchLinear(nn.Module):
    """Logits from every pixel of the patch, so a wrong halo or edge reflection shows in the map."""

    def __init__(self, bands: int, patch_size: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(bands * patch_size**2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def test_blocks_with_a_halo_match_the_whole_padded_scene():
    torch.manual_seed(0)
    rows, cols, bands, patch, classes = 11, 7, 3, 5, 6
    cube = np.random.default_rng(0).normal(size=(rows, cols, bands)).astype(np.float32)
    prep = FittedPreprocessing(
        bands, np.arange(bands), BandNormalizer("none"), None, patch, [f"c{i}" for i in range(classes)], None, None, {}
    )
    model = _PatchLinear(bands, patch, classes).eval()
    gatherer = PatchGatherer(pad_reflect(cube, patch), patch)
    grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    with torch.inference_mode():
        expected = (model(gatherer.gather(grid)).argmax(1) + 1).reshape(rows, cols).numpy()
    assert len(np.unique(expected)) > 2
    source, options = cube_from_array(cube, "cube"), PredictOptions(progress=False)
    for block_rows in (1, 2, 4, rows):
        got = _map_blocks(model, prep, source, block_rows, 5, None, options)
        np.testing.assert_array_equal(got, expected, err_msg=f"block_rows={block_rows}")


@pytest.mark.realdata
def test_salinas_a_as_envi_and_a_geotiff_fits_and_predicts_the_same_map(shared_data, tmp_path, monkeypatch):
    folder = shared_data / "salinas_a"
    cube = read_mat(folder / "SalinasA_corrected.mat")["salinasA_corrected"]
    codes = read_mat(folder / "SalinasA_gt.mat")["salinasA_gt"]
    fx.write_envi(tmp_path / "salinas_a.hdr", cube)
    crs, _ = fx.write_geotiff_cube(tmp_path / "gt.tif", codes[:, :, None].astype(np.uint8), epsg=32610)
    monkeypatch.chdir(tmp_path)
    fit = ["data.scene=salinas_a.hdr", "data.labels=gt.tif", "train.max_epochs=2", "preflight.probe_steps=2", *FIT]
    assert main(["fit", *fit]) == 0
    run = _only(tmp_path / "runs" / "quickstart")
    assert main(["predict", f"run={run}", "progress=false"]) == 0
    expected, run_crs = _read(run / "prediction.tif")
    got, got_crs = _read(_only(run / "predict") / "prediction.tif")
    assert got.shape == (1, 83, 86) and got_crs == run_crs == crs
    assert set(np.unique(got)) <= {1, 10, 11, 12, 13, 14}  # Salinas-A's own codes
    np.testing.assert_array_equal(got, expected)
