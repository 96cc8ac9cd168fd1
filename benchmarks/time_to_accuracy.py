"""Time to a good model: each shipped one-device recipe that runs here, beside RBF-SVMs on the very same split.

    python benchmarks/time_to_accuracy.py --data-root ../shared/data                    # every recipe that runs here
    python benchmarks/time_to_accuracy.py --data-root ../shared/data --recipes salinas_a_1gpu \
        --protocols stratified disjoint                                                 # both splits of a recipe
    python benchmarks/time_to_accuracy.py --recipes quickstart --max-epochs 2           # a quick pass (rows say so)

A recipe runs on its own scene when the scene's files are under --data-root, an Indian Pines recipe on the synthetic
Indian Pines scene (same shape and class counts) when the real cube is absent, and is listed as skipped otherwise.
Each row is the README's command, `hslite fit recipe=R data.root=...`, run in a fresh folder and timed whole (start-up,
pre-flight, training, test, map). Beside it, two RBF-SVMs (scikit-learn) on the run's own split.npz: on the run's kept,
normalised bands of each pixel, and on those plus their mean over the recipe's patch window (the common "spectral +
spatial mean" baseline). C and gamma are chosen on the run's validation pixels, as the run chooses its checkpoint, and
the SVM's wall time counts that whole grid. "to SVM" is the recipe's training time until its validation OA first
reached the SVM's (the better SVM's, selected on those same validation pixels, so the target is if anything high).
The last line is the worst margin of a recipe over the better SVM, in OA points.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
C_GRID = (1.0, 10.0, 100.0, 1000.0, 10000.0)
GAMMA_FACTORS = (0.1, 0.3, 1.0, 3.0, 10.0)  # × scikit-learn's "scale", 1 / (features × variance)


@dataclass
class Row:
    """One line of the table."""

    scene: str
    protocol: str
    method: str
    oa: float
    aa: float
    kappa: float
    seconds: float
    to_svm: float | None = None
    note: str = ""


def _one_device_recipes() -> list[str]:
    """Shipped recipes for one device, less `hslite compare`'s set (short timed runs, not recipes to train with)."""
    from hslite.recipe.config import list_recipes, load_config

    names = [name for name in list_recipes() if not name.startswith("compare_")]
    return [name for name in names if load_config(name).parallel.devices == 1]


def _scene_to_run(recipe: str, data_root: Path | None) -> tuple[str | None, str]:
    """The scene the recipe runs on here, or None and why not."""
    from hslite.datasets.scenes import get_scene_spec, is_synthetic, scene_folder
    from hslite.recipe.config import load_config

    name = load_config(recipe).data.scene
    if is_synthetic(name):
        return name, ""
    spec = get_scene_spec(name)
    if data_root is not None and (scene_folder(name, data_root) / Path(spec.cube_file.name)).is_file():
        return name, ""
    if name == "indian_pines":
        return "synthetic_indian_pines", "synthetic stand-in"
    return None, f"{spec.cube_file.name} is not under --data-root"


def _fit(recipe: str, scene: str, protocol: str, overrides: list[str], data_root: Path | None, work: Path) -> Path:
    """Run the README's command in `work`, timed whole; returns the run folder."""
    command = [
        sys.executable,
        "-m",
        "hslite.cli",
        "fit",
        f"recipe={recipe}",
        f"data.scene={scene}",
        f"data.split={protocol}",
        "train.progress=false",
        *overrides,
    ]
    if data_root is not None:
        command.append(f"data.root={data_root}")
    work.mkdir(parents=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    (run,) = [p for p in (work / "runs").glob("*/*") if (p / "metrics.json").is_file()]
    (run / "command_seconds.txt").write_text(f"{seconds}\n")
    return run


def _val_curve(run: Path) -> list[tuple[float, float]]:
    """(training seconds, validation OA) at each validation of the run, from its metrics.csv."""
    with (run / "logs" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/elapsed_seconds") and r.get("val/OA")]
    return [(float(r["perf/elapsed_seconds"]), float(r["val/OA"])) for r in rows]


def _features(run: Path, with_mean: bool) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Per-pixel features of the run's scene (its kept, normalised bands; + their window mean) and its split."""
    from scipy.ndimage import uniform_filter

    from hslite.datasets.fitted import FittedPreprocessing
    from hslite.datasets.scenes import load_scene
    from hslite.datasets.splits import Split

    prep = FittedPreprocessing.load(run / "preprocessing.npz")
    source = prep.scene
    scene = load_scene(source["name"], source["root"], seed=source["seed"])
    cube = replace(prep, pca=None).apply(scene.cube).astype(np.float32)
    if with_mean:
        window = max(3, prep.patch_size)
        cube = np.concatenate([cube, uniform_filter(cube, size=(window, window, 1), mode="reflect")], axis=2)
    split = Split.load(run / "split.npz")
    subsets = {name: getattr(split, name) for name in ("train", "val", "test")}
    return cube, scene.gt, subsets


def _svm(run: Path, with_mean: bool) -> tuple[Row, float]:
    """The RBF-SVM on the run's split, C and gamma chosen on its validation pixels; (row, its validation OA)."""
    from sklearn.metrics import accuracy_score, balanced_accuracy_score, cohen_kappa_score
    from sklearn.svm import SVC

    cube, gt, subsets = _features(run, with_mean)
    x = {k: cube[c[:, 0], c[:, 1]] for k, c in subsets.items()}
    y = {k: gt[c[:, 0], c[:, 1]] for k, c in subsets.items()}
    start = time.perf_counter()
    scale = 1.0 / (x["train"].shape[1] * x["train"].var())
    best: tuple[float, SVC] | None = None
    for c in C_GRID:
        for factor in GAMMA_FACTORS:
            model = SVC(C=c, gamma=factor * scale).fit(x["train"], y["train"])
            score = accuracy_score(y["val"], model.predict(x["val"])) if len(y["val"]) else 0.0
            if best is None or score > best[0]:
                best = (score, model)
    assert best is not None
    predicted = best[1].predict(x["test"])
    seconds = time.perf_counter() - start
    method = "RBF-SVM pixels + window mean" if with_mean else "RBF-SVM pixels"
    row = Row(
        "",
        "",
        method,
        accuracy_score(y["test"], predicted),
        balanced_accuracy_score(y["test"], predicted),
        cohen_kappa_score(y["test"], predicted),
        seconds,
        note=f"C={best[1].C:g}",
    )
    return row, best[0]


def _recipe_row(recipe: str, run: Path, target_val_oa: float, note: str) -> Row:
    metrics = json.loads((run / "metrics.json").read_text())
    seconds = float((run / "command_seconds.txt").read_text())
    reached = [t for t, oa in _val_curve(run) if oa >= target_val_oa]
    return Row(
        "",
        "",
        f"hslite {recipe}",
        metrics["OA"],
        metrics["AA"],
        metrics["kappa"],
        seconds,
        reached[0] if reached else None,
        note,
    )


def _header() -> None:
    print(
        f"{'scene':24} {'split':11} {'method':40} {'OA %':>6} {'AA %':>6} {'kappa':>6} {'wall s':>7} "
        f"{'to SVM s':>8}  note",
        flush=True,
    )


def _print(r: Row) -> None:
    to_svm = "-" if r.method.startswith("RBF") else ("never" if r.to_svm is None else f"{r.to_svm:.1f}")
    print(
        f"{r.scene:24} {r.protocol:11} {r.method:40} {100 * r.oa:6.2f} {100 * r.aa:6.2f} {r.kappa:6.3f} "
        f"{r.seconds:7.1f} {to_svm:>8}  {r.note}",
        flush=True,
    )


def main() -> int:
    """Run every (recipe, protocol) and its SVMs; print the table and the worst margin."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, help="folder of the real scenes (e.g. ../shared/data)")
    parser.add_argument("--recipes", nargs="+", help="default: every shipped one-device recipe")
    parser.add_argument("--protocols", nargs="+", default=["stratified"], choices=("stratified", "disjoint"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-epochs", type=int, help="cap every recipe's epochs (a quick pass; rows say so)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every fit (noted)")
    args = parser.parse_args()
    data_root = args.data_root.resolve() if args.data_root else None

    margins: list[float] = []
    _header()
    with tempfile.TemporaryDirectory(prefix="hslite-tta-") as tmp:
        for i, recipe in enumerate(args.recipes or _one_device_recipes()):
            scene, why = _scene_to_run(recipe, data_root)
            if scene is None:
                print(f"skipped {recipe}: {why}", flush=True)
                continue
            overrides = [f"train.seed={args.seed}", *args.set]
            note = ", ".join(filter(None, [why, *args.set]))
            if args.max_epochs:
                overrides.append(f"train.max_epochs={args.max_epochs}")
                note = ", ".join(filter(None, [note, f"capped at {args.max_epochs} epochs"]))
            for protocol in args.protocols:
                run = _fit(recipe, scene, protocol, overrides, data_root, Path(tmp) / f"{i}-{protocol}")
                svms = [_svm(run, with_mean) for with_mean in (False, True)]
                best_val = max(val_oa for _, val_oa in svms)
                ours = _recipe_row(recipe, run, best_val, note)
                for row in (ours, *(s[0] for s in svms)):
                    row.scene, row.protocol = scene, protocol
                    _print(row)
                margins.append(100 * (ours.oa - max(s[0].oa for s in svms)))
    if not margins:
        print("no recipe ran: pass --data-root or --recipes of a synthetic scene")
        return 1
    print(f"worst margin over the better SVM: {min(margins):+.2f} OA points")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
