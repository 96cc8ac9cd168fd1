"""Map a cube with a finished run: `hslite predict run=RUN_DIR [cube=PATH] [key=value…]`.

As a library call:

    from hslite.run.predict import PredictOptions, predict
    result = predict(PredictOptions(run="runs/quickstart/20250101-120000-000000", probabilities=True))

The model is rebuilt from the run's config.yaml and loaded from checkpoints/best.ckpt (weights only); the run's fitted
preprocessing (preprocessing.npz) is applied to blocks of rows, each read with a halo of patch_size // 2 rows and
reflected at the scene's edges as fit padded the whole scene, so memory holds one block and its patches, never the
patches of the whole cube. Outputs go to a new folder, RUN_DIR/predict/<stamp>/ (or OUTPUT/<stamp>/), never over the
run's own: prediction.tif (in the label file's codes, georeferenced when the input is), map.png, predict.json and,
when asked, probabilities.tif (float32, one band per class).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hslite.datasets.fitted import FittedPreprocessing
from hslite.datasets.preprocess import patch_radius
from hslite.datasets.scene_input import scene_tiles
from hslite.datasets.scenes.cube_file import CubeFile
from hslite.datasets.scenes.geotiff_out import geotiff_writer, write_geotiff
from hslite.datasets.scenes.own_scene import OwnScene, open_cube_spec
from hslite.datasets.scenes.registry import get_scene_spec, load_scene, to_label_codes
from hslite.errors import ConfigError, DataError
from hslite.parallel.channels.rotation import RotationSchedule, SubsetEnsemble
from hslite.recipe.build import model_for
from hslite.recipe.config import load_config, parse_overrides
from hslite.recipe.schema import Config
from hslite.run.checkpoints import read_checkpoint
from hslite.run.folder import RunFolder, check_writable
from hslite.run.outputs import plot_map, write_json
from hslite.run.resume import check_checkpoint_config


@dataclass
class PredictOptions:
    """The key=value options of `hslite predict`."""

    run: str = ""  # run folder that `hslite fit` wrote (runs/<recipe>/<stamp>); required
    cube: str | None = None  # cube to map, PATH or FILE.mat:NAME, with the run's raw bands; None means the run's scene
    output: str | None = None  # folder under which <stamp>/ is made; None means RUN_DIR/predict
    probabilities: bool = False  # also write probabilities.tif: float32, one band per class
    batch_size: int = 0  # patches per forward pass; 0 means the run's data.eval_batch_size
    tile_rows: int = 0  # rows per block; 0 means as many as hold BLOCK_BYTES of raw cube
    accelerator: str = "auto"  # "cpu", "gpu", or "auto" (gpu when CUDA is available)
    progress: bool = True  # rich progress bar


@dataclass
class PredictResult:
    """What a prediction left behind: its folder and the classes (1..C) of every pixel."""

    out_dir: Path
    classes: np.ndarray
    georeference: str  # where prediction.tif's CRS and transform came from, or why it has none


def parse_options(items: list[str]) -> PredictOptions:
    """`key=value` items -> PredictOptions; an unknown key or a bad value is a ConfigError naming it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    known = [f.name for f in fields(PredictOptions)]
    pairs = parse_overrides(items)
    unknown = [key for key, _ in pairs if key not in known]
    if unknown:
        raise ConfigError(f"hslite predict has no option {unknown[0]!r}; its options are {', '.join(known)}.")
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(PredictOptions), OmegaConf.from_dotlist([f"{k}={v}" for k, v in pairs])
        )
    except OmegaConfBaseException as err:
        raise ConfigError(f"hslite predict: bad value for {err.full_key!r}: {str(err).splitlines()[0]}.") from None
    options: PredictOptions = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if not options.run:
        raise ConfigError("hslite predict needs run=RUN_DIR, a folder that hslite fit wrote (runs/<recipe>/<stamp>).")
    negative = [f"{key}={getattr(options, key)}" for key in ("batch_size", "tile_rows") if getattr(options, key) < 0]
    if negative:
        raise ConfigError(f"{', '.join(negative)}: give a positive number, or 0 for the default.")
    if options.accelerator not in ("auto", "cpu", "gpu"):
        raise ConfigError(f"accelerator must be auto, cpu or gpu; got {options.accelerator!r}.")
    return options


def load_run(run_dir: Path) -> tuple[Config, FittedPreprocessing, nn.Module]:
    """The run's config, fitted preprocessing and model with its best weights; a missing part is a DataError."""
    if not run_dir.is_dir():
        raise DataError(
            f"{run_dir} does not exist; pass run=DIR, a folder that hslite fit wrote (runs/<recipe>/<stamp>)."
        )
    config, checkpoint = run_dir / "config.yaml", run_dir / "checkpoints" / "best.ckpt"
    if not config.is_file():
        raise DataError(f"{run_dir} has no config.yaml, so it is not a run folder of hslite fit.")
    if not checkpoint.is_file():
        raise DataError(
            f"{run_dir} has no checkpoints/best.ckpt (it ran with output.save_checkpoint=false, or stopped before its "
            "first validation); train it again to predict with it."
        )
    try:
        cfg = load_config(str(config))
    except ConfigError as err:
        raise DataError(f"{config} is damaged, so the run cannot be read back: {err}") from None
    prep = FittedPreprocessing.load(run_dir / "preprocessing.npz")
    model = model_for(cfg, prep.num_input_bands, prep.num_classes, prep.input_wavelengths_nm)
    stored = read_checkpoint(checkpoint)
    if "hslite" in stored:  # runs of hslite before checkpoints carried their config have no such entry
        check_checkpoint_config(stored, cfg, checkpoint)
    weights = stored.get("state_dict")
    if not isinstance(weights, dict):
        raise DataError(f"{checkpoint} holds no model state (no 'state_dict'); it is not a checkpoint of hslite fit.")
    try:
        model.load_state_dict({k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")})
    except RuntimeError as err:
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:3])  # the missing / unexpected keys
        raise DataError(f"{checkpoint} does not hold this run's {type(model).__name__}: {detail}") from err
    p = cfg.parallel
    if p.rotation_groups and hasattr(model, "encode_groups"):  # evaluated as fit evaluated it: the subsets' ensemble
        banded: Any = model  # the band-group protocol (models/band_groups.py), which nn.Module does not declare
        model = SubsetEnsemble(model, RotationSchedule(banded.band_groups, p.rotation_groups, cfg.train.seed, p.chag))
    return cfg, prep, model


def _run_scene(prep: FittedPreprocessing) -> tuple[CubeFile, np.ndarray]:
    """The run's own scene, loaded as fit loaded it, and its ground truth (classes 1..C)."""
    source = dict(prep.scene)
    if source.pop("kind") == "own":
        scene = OwnScene(**{**source, "class_names": tuple(source["class_names"])}).load()
    else:
        scene = load_scene(source["name"], source["root"], seed=source["seed"])
    return replace(scene.source, crs=scene.crs, transform=scene.transform), scene.gt


def _run_scene_shape(prep: FittedPreprocessing) -> tuple[int, int, int]:
    """The run's scene's (rows, cols, bands) as its file's header or its registered spec says, no pixel read."""
    source = prep.scene
    if source["kind"] == "own":
        return open_cube_spec(source["cube"]).shape
    return get_scene_spec(source["name"]).shape


def _georeferenced(source: CubeFile, prep: FittedPreprocessing) -> tuple[CubeFile, str]:
    """The cube with the georeference its map is written with, and a phrase saying where that came from.

    A cube file without one (an ENVI cube whose georeference was in the run's label GeoTIFF, a .npy) that is the
    run's scene (same shape and bands, same values in its first rows) takes the run's scene's.
    """
    if source.crs is not None or source.transform is not None:
        return source, f"the cube's own ({source.source})"
    shape = _run_scene_shape(prep)  # from a header or the scene's spec: the scene is loaded only if it may be this cube
    if shape != source.shape:
        return source, f"none (the cube has none, and its shape {source.shape} is not the run's scene's {shape})"
    scene, _ = _run_scene(prep)
    if scene.crs is None and scene.transform is None:
        return source, "none (neither the cube nor the run's scene has one)"
    rows = min(8, source.shape[0])
    if not np.array_equal(source.read(0, rows), scene.read(0, rows)):
        return source, "none (the cube has none, and its values are not the run's scene's, though its shape is)"
    return replace(source, crs=scene.crs, transform=scene.transform), f"the run's scene's ({scene.source})"


def predict(options: PredictOptions) -> PredictResult:
    """Map `options.cube` (by default the run's own scene) with the run in `options.run`."""
    run_dir = Path(options.run).expanduser()
    cfg, prep, model = load_run(run_dir)
    if options.cube is None:
        source, gt = _run_scene(prep)
        georeference = "the run's scene's" if source.crs is not None or source.transform is not None else "none"
    else:
        source, gt = open_cube_spec(options.cube), None
    height, width, bands = source.shape
    if bands != prep.raw_bands:
        raise DataError(
            f"{source.source} has {bands} bands but run {run_dir} was trained on a {prep.raw_bands}-band cube; "
            "predict needs a cube from the same sensor with the same bands."
        )
    if options.cube is not None:
        source, georeference = _georeferenced(source, prep)
    if patch_radius(prep.patch_size) >= min(height, width):
        raise DataError(
            f"{source.source} is {height}×{width} pixels, too small for the run's {prep.patch_size}-pixel patches."
        )
    accelerator = "gpu" if options.accelerator == "auto" and torch.cuda.is_available() else options.accelerator
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError("accelerator=gpu but no CUDA device is visible here; use accelerator=cpu.")
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    block_rows = min(height, options.tile_rows or source.block_rows())
    batch_size = options.batch_size or cfg.data.eval_batch_size
    started = time.perf_counter()
    out_root = Path(options.output).expanduser() if options.output else run_dir / "predict"
    check_writable(out_root)
    with RunFolder(out_root) as folder:
        with ExitStack() as stack:
            writer = None
            if options.probabilities:
                writer = stack.enter_context(
                    geotiff_writer(folder.path / "probabilities.tif", (height, width), prep.num_classes, np.float32,
                                   source.crs, source.transform)
                )  # fmt: skip
                for band, name in enumerate(prep.class_names, start=1):
                    writer.set_band_description(band, name)
            classes = _map_blocks(model.to(device).eval(), prep, source, block_rows, batch_size, writer, options)
        codes = to_label_codes(classes, prep.label_codes)
        write_geotiff(folder.path / "prediction.tif", codes, source.crs, source.transform)
        plot_map(folder.path / "map.png", classes, gt, prep.class_names, prep.label_codes)
        seconds = time.perf_counter() - started
        write_json(folder.path / "predict.json", {
            "run": str(run_dir.resolve()), "cube": options.cube or "the run's scene", "shape": list(source.shape),
            "georeferenced": source.crs is not None, "georeference": georeference, "block_rows": block_rows,
            "seconds": seconds,
            "pixels_per_second": height * width / max(seconds, 1e-9),
            "pixels_per_class": _pixels_per_class(codes, prep),
        })  # fmt: skip
    return PredictResult(folder.path, classes, georeference)


def _map_blocks(
    model: nn.Module,
    prep: FittedPreprocessing,
    source: CubeFile,
    block_rows: int,
    batch_size: int,
    writer: Any,
    options: PredictOptions,
) -> np.ndarray:
    """Classes 1..C of every pixel, a block of rows at a time; each block's probabilities go to `writer` if any."""
    from rasterio.windows import Window
    from rich.progress import Progress

    height, width, _ = source.shape
    device = next(model.parameters()).device
    classes = np.zeros((height, width), dtype=np.min_scalar_type(prep.num_classes))
    with Progress(disable=not options.progress) as bar:
        task = bar.add_task(f"predicting {height}×{width} pixels", total=height)
        transform = prep.apply  # (block, first_row) -> the model's bands, as the datamodule made them in fit
        for start, stop, gatherer in scene_tiles(source, transform, prep.patch_size, block_rows):
            grid = torch.stack(torch.meshgrid(torch.arange(stop - start), torch.arange(width), indexing="ij"), -1)
            with torch.inference_mode():
                logits = torch.cat(
                    [
                        model(gatherer.gather(batch).to(device)).float().cpu()
                        for batch in grid.reshape(-1, 2).split(batch_size)
                    ]
                )
            classes[start:stop] = (logits.argmax(1) + 1).reshape(stop - start, width).numpy()
            if writer is not None:
                probabilities = torch.softmax(logits, 1).reshape(stop - start, width, -1).permute(2, 0, 1)
                writer.write(probabilities.numpy(), window=Window(0, start, width, stop - start))
            bar.advance(task, stop - start)
    return classes


def _pixels_per_class(codes: np.ndarray, prep: FittedPreprocessing) -> dict[str, int]:
    values, counts = np.unique(codes, return_counts=True)
    written = to_label_codes(np.arange(1, prep.num_classes + 1), prep.label_codes).tolist()
    names = dict(zip(written, prep.class_names, strict=True))
    return {f"{int(v)} {names[int(v)]}": int(n) for v, n in zip(values, counts, strict=True)}
