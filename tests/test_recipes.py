"""Every shipped recipe trains end to end on CPU for a few batches, and a built wheel finds the recipes by name.

Synthetic scenes are generated, so their recipes always run. For a file scene, the real files of ../shared/data are
copied in where it has them, and real-format stand-ins are written for what it lacks (file and variable name, dtype,
full shape), so the recipe's own loader, preprocessing and model run for real. A stand-in label map can only be
written as GeoTIFF: a scene whose labels are a .mat file needs ../shared/data and skips, saying so, without it.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from fixtures_data import write_geotiff_cube, write_real_format_cube

from hslite.datasets.scenes.registry import get_scene_spec, is_synthetic
from hslite.recipe.config import list_recipes, load_config

REPO = Path(__file__).resolve().parents[1]

QUICK = [
    "data.eval_batch_size=128",
    "train.max_epochs=1",
    "train.limit_train_batches=2",
    "train.limit_val_batches=2",  # a count above 1; 1.0 would mean all
    "train.limit_test_batches=2",
    "train.progress=false",
    "output.save_map=false",
    "preflight.enabled=false",
]


def _needs_real_files(scene: str) -> bool:
    """Whether the scene's ground truth can only come from ../shared/data (no stand-in is written for .mat labels)."""
    return not is_synthetic(scene) and not get_scene_spec(scene).gt_file.name.endswith(".tif")


def _lay_out_scene(scene: str, root: Path, shared_data: Path | None, monkeypatch) -> None:
    """Real files where ../shared/data has them, real-format stand-ins for the cubes it lacks.

    A stand-in cannot match the real file's size and sha256, so those two are lifted for the stand-in only.
    """
    from hslite.datasets.scenes import registry as scenes

    spec = get_scene_spec(scene)
    folder = root / scene
    folder.mkdir(parents=True, exist_ok=True)
    if shared_data is not None:
        for remote in (spec.cube_file, spec.gt_file):
            if (shared_data / scene / remote.name).is_file():
                shutil.copy(shared_data / scene / remote.name, folder / remote.name)
    if not (folder / spec.cube_file.name).is_file():
        if spec.cube_file.name.endswith(".tif"):
            rng = np.random.default_rng(0)
            write_geotiff_cube(folder / spec.cube_file.name, rng.integers(0, 4000, spec.shape).astype(np.int16))
        else:
            write_real_format_cube(folder, scene)
        unchecked = dataclasses.replace(spec.cube_file, sha256=None, size_bytes=None)
        monkeypatch.setitem(scenes._SCENES, scene, dataclasses.replace(spec, cube_file=unchecked))
    if not (folder / spec.gt_file.name).is_file():
        if not spec.gt_file.name.endswith(".tif"):
            pytest.skip(f"{scene}'s ground truth {spec.gt_file.name} is not in {shared_data / scene}")
        rows, cols, _ = spec.shape
        labels = (np.arange(rows * cols).reshape(rows, cols) % (len(spec.class_names) + 1)).astype(np.uint8)
        write_geotiff_cube(folder / spec.gt_file.name, labels[..., None])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(list_recipes()))
def test_recipe_smoke_run(recipe, tmp_path, request, monkeypatch):
    from hslite.run.fit import fit

    cfg = load_config(recipe)
    overrides = [*QUICK, f"output.root={tmp_path / 'runs'}"]
    if cfg.parallel.accelerator == "gpu":
        # A GPU recipe's data, model and precision on one CPU process. Its multi-process path is the one
        # quickstart_cpu2/4 and test_ddp run; spawned ranks would not see the checksum lifted for stand-in cubes.
        # bf16 on this AVX2 CPU is ~10x slower than fp32 (DISTRIBUTED-NOTES): AMP is tested on a small model instead.
        overrides += ["parallel.accelerator=cpu", "parallel.devices=1", "parallel.num_nodes=1", "parallel.chag=1"]
        overrides += ["parallel.precision=32-true", "data.eval_batch_size=64"]
    if cfg.model.size.startswith("vit_"):
        # Foundation sizes (0.1-4 B parameters) do not train on a CPU: their data and plan run here with the small
        # preset, and tests/test_foundation_recipes.py prices them at their own size.
        overrides += ["model.size=small", "data.batch_size=8", "data.eval_batch_size=16"]
    scene = cfg.data.scene
    if not is_synthetic(scene):
        # Only a scene that needs real files asks for the fixture, which skips when ../shared/data is absent.
        shared_data = request.getfixturevalue("shared_data") if _needs_real_files(scene) else None
        _lay_out_scene(scene, tmp_path / "data", shared_data, monkeypatch)
        overrides.append(f"data.root={tmp_path / 'data'}")
    cfg = load_config(recipe, overrides)
    result = fit(cfg)
    metrics = json.loads((result.run_dir / "metrics.json").read_text())
    _assert_scores_describe_the_test_pixels(metrics, int(cfg.train.limit_test_batches), cfg.data.eval_batch_size)


def _assert_scores_describe_the_test_pixels(metrics: dict, test_batches: int, batch_size: int) -> None:
    """The test batches' pixels were scored, and OA and per-class accuracy are what their confusion matrix says.

    A smoke run of one epoch has no accuracy worth asserting; that every figure comes from the pixels it scored does.
    """
    confusion = np.array(metrics["confusion_matrix"])
    classes = len(metrics["class_names"])
    assert confusion.shape == (classes, classes)
    assert confusion.sum() == min(test_batches * batch_size, sum(metrics["split_counts"]["test"].values()))
    assert metrics["OA"] == pytest.approx(np.trace(confusion) / confusion.sum())
    seen = confusion.sum(axis=1)
    assert metrics["per_class_accuracy"] == pytest.approx(
        [confusion[i, i] / n if n else None for i, n in enumerate(seen)]
    )


@pytest.mark.slow
def test_wheel_holds_every_module_and_finds_recipes_by_name(tmp_path):
    """The recipes live in the top-level recipes/ folder; a wheel must ship them as hslite.recipes, and the C kernel.

    The package list in pyproject.toml is written out by hand (package-dir mapping), so this also checks that no
    module of the tree is left out of the wheel. The editable install is the one every other test runs under.
    """
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("hslite", "recipes"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", tmp_path / "wheel", source], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("hslite-*.whl")

    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"hslite/{p.relative_to(source / 'hslite').as_posix()}" for p in (source / "hslite").rglob("*.py")}
    expected |= {f"hslite/recipes/{p.name}" for p in (source / "recipes").iterdir() if p.suffix in (".py", ".yaml")}
    for data in ("topologies", "devices"):
        folder = source / "hslite" / "preflight_check" / "hardware" / data
        expected |= {f"hslite/preflight_check/hardware/{data}/{p.name}" for p in folder.glob("*.yaml")}
    assert any(
        "preflight_check/hardware/devices/" in name for name in expected
    )  # the data folders were found, not skipped
    assert sorted(expected - shipped) == []
    if shutil.which("cc"):  # the patch gather's C kernel, compiled for the wheel (it is optional without a compiler)
        assert any(name.startswith("hslite/datasets/batches/_patchgather.") for name in shipped - expected)

    target = tmp_path / "installed"
    subprocess.run([*pip, "install", "--no-deps", "--target", target, wheel], check=True, capture_output=True)
    probe = (
        "import hslite.recipes, hslite.recipe.config as c; print(hslite.recipes.__file__); print(*c.list_recipes()); "
        "print(c.load_config('salinas_a_1gpu').recipe)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    where, names, loaded = run.stdout.splitlines()
    assert Path(where).is_relative_to(target)  # the wheel's copy, not the editable checkout
    assert set(names.split()) == {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    assert loaded == "salinas_a_1gpu"


def test_recipes_of_one_training_agree_on_its_global_batch():
    """Recipes that train one model on one input at one learning rate differ only in layout: the same global batch.

    hslite keeps the global batch when it compares or picks plans (`compare`, `parallel.plan=auto`) instead of
    rescaling the learning rate, so the shipped alternatives of one training keep it too (docs/design.md); a recipe
    that trains at another global batch is another training and chooses its own rate.
    """
    from hslite.recipe.build import plan_from_config

    trainings: dict[tuple, dict[str, int]] = {}
    for name in list_recipes():
        cfg = load_config(name)
        model, data = cfg.model, cfg.data
        key = (data.scene, model.name, model.size, data.patch_size, data.pca_components, cfg.train.lr)
        trainings.setdefault(key, {})[name] = plan_from_config(cfg).global_batch
    for recipes in trainings.values():
        assert len(set(recipes.values())) == 1, f"one training, several global batches: {recipes}"
