"""Time to a good model: each shipped one-device recipe that runs here, beside RBF-SVMs on the very same split.

    python benchmarks/time_to_accuracy.py --data-root ../shared/data --seeds 0 1 2 \
        --protocols stratified disjoint                                                 # the whole table
    python benchmarks/time_to_accuracy.py --data-root ../shared/data --recipes salinas_a_1gpu
    python benchmarks/time_to_accuracy.py --recipes quickstart --max-epochs 2           # a quick pass (rows say so)
    python benchmarks/time_to_accuracy.py --data-root ../shared/data --recipes indian_pines_1gpu --seeds 0 1 2 \
        --protocols stratified disjoint --stand-ins-too                        # does the stand-in predict the scene?

A recipe runs on its own scene whenever the scene's files are under --data-root (by default where `hslite fit` reads
scenes: $HSLITE_DATA, else hslite's user cache), on the synthetic stand-in of that scene (same bands, classes and class
balance; `hslite data list`) when they are not, and is listed as skipped when there is neither. A stand-in's figure does
not carry over to its real scene, so real scenes and stand-ins are tabled and counted apart. Each run is the README's
command, `hslite fit recipe=R data.root=... train.seed=S`, in a fresh folder and timed whole (start-up, pre-flight,
training, test, map). Beside it, two RBF-SVMs (scikit-learn) on the run's own split.npz: on the run's kept, normalised
bands of each pixel, and on those plus their mean over the recipe's patch window (at least 3×3: the common "spectral +
spatial mean" baseline). The baseline is made as strong as it honestly can be: features z-scored on the training pixels,
C (1 to 10⁴) and gamma (10⁻⁴ to 10⁻¹, and "scale") chosen on the validation pixels, as the run chooses its checkpoint,
then refit on training + validation pixels, which the run never trains on; the SVM's wall time counts that whole grid
and the refit.

A line per seed as it finishes, then per recipe and protocol the mean ± spread (sample standard deviation) over the
seeds of the recipe and of each SVM. "to SVM" is the recipe's training time until its validation OA first reached
the better SVM's (the better one on those same validation pixels before the refit, so the target is if anything high),
averaged over the seeds that reached it. The last lines count, for stand-ins and real scenes apart, the recipe ×
protocol pairs whose mean OA is at or above the better SVM's mean OA (`real scenes: recipes at or above the better
SVM: N of M`). With --stand-ins-too each real scene's recipes also run on its stand-in, and a last table sets the
stand-in's mean OA beside the real scene's for the recipe and each SVM, ending with `stand-ins within ±3 OA points of
their real scene: N of M`: a stand-in is only worth its figures where it is as hard as its scene.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
C_GRID = tuple(10.0**k for k in range(5))  # 1 … 10⁴
GAMMA_GRID: tuple[float | str, ...] = (*(10.0**k for k in range(-4, 0)), "scale")  # "scale" = 1 / features, z-scored
SVM_METHODS = ("RBF-SVM pixels", "RBF-SVM pixels + window mean")
STAND_IN_TOLERANCE = 3.0  # OA points: a stand-in predicts its real scene when its mean OA is this close


@dataclass
class Score:
    """One method's result on one seed's split."""

    oa: float
    aa: float
    kappa: float
    seconds: float
    to_svm: float | None = None  # recipes: training seconds until validation OA first reached the better SVM's
    note: str = ""


def _one_device_recipes() -> list[str]:
    """Shipped recipes for one device, less `hslite compare`'s set (short timed runs, not recipes to train with)."""
    from hslite.recipe.config import list_recipes, load_config

    names = [name for name in list_recipes() if not name.startswith("compare_")]
    return [name for name in names if load_config(name).parallel.devices == 1]


def _scene_to_run(recipe: str, data_root: Path) -> tuple[str | None, str]:
    """The scene the recipe runs on here (its own, or its synthetic stand-in), or None and why not."""
    from hslite.datasets.scenes.registry import get_scene_spec, is_synthetic, list_scenes, scene_folder
    from hslite.recipe.config import load_config

    name = load_config(recipe).data.scene
    if is_synthetic(name):
        return name, ""
    spec = get_scene_spec(name)
    if (scene_folder(name, data_root) / Path(spec.cube_file.name)).is_file():
        return name, ""
    if f"synthetic_{name}" in list_scenes():
        return f"synthetic_{name}", "synthetic stand-in"
    return None, f"{spec.cube_file.name} is not under --data-root and {name} has no synthetic stand-in"


def _fit(recipe: str, scene: str, protocol: str, overrides: list[str], data_root: Path, work: Path) -> Path:
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
        f"data.root={data_root}",
    ]
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
    from hslite.datasets.scenes.registry import load_scene
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


def _svm(run: Path, with_mean: bool) -> tuple[Score, float]:
    """The RBF-SVM on the run's split: z-scored on train, C and gamma chosen on val, refit on train + val.

    Returns its test score and the validation OA of the chosen (C, gamma) before the refit.
    """
    from sklearn.metrics import accuracy_score, balanced_accuracy_score, cohen_kappa_score
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    cube, gt, subsets = _features(run, with_mean)
    x = {k: cube[c[:, 0], c[:, 1]] for k, c in subsets.items()}
    y = {k: gt[c[:, 0], c[:, 1]] for k, c in subsets.items()}
    start = time.perf_counter()
    scaler = StandardScaler().fit(x["train"])
    x = {k: scaler.transform(v) for k, v in x.items()}
    best: tuple[float, float, float | str] | None = None
    for c in C_GRID:
        for gamma in GAMMA_GRID:
            model = SVC(C=c, gamma=gamma).fit(x["train"], y["train"])
            score = accuracy_score(y["val"], model.predict(x["val"])) if len(y["val"]) else 0.0
            if best is None or score > best[0]:
                best = (score, c, gamma)
    assert best is not None
    val_oa, c, gamma = best
    model = SVC(C=c, gamma=gamma).fit(np.concatenate([x["train"], x["val"]]), np.concatenate([y["train"], y["val"]]))
    predicted = model.predict(x["test"])
    seconds = time.perf_counter() - start
    gamma_text = gamma if isinstance(gamma, str) else f"{gamma:g}"
    score = Score(
        accuracy_score(y["test"], predicted),
        balanced_accuracy_score(y["test"], predicted),
        cohen_kappa_score(y["test"], predicted),
        seconds,
        note=f"C={c:g} gamma={gamma_text}",
    )
    return score, val_oa


def _recipe_score(run: Path, target_val_oa: float, note: str) -> Score:
    metrics = json.loads((run / "metrics.json").read_text())
    seconds = float((run / "command_seconds.txt").read_text())
    reached = [t for t, oa in _val_curve(run) if oa >= target_val_oa]
    return Score(metrics["OA"], metrics["AA"], metrics["kappa"], seconds, reached[0] if reached else None, note)


def _to_svm_text(times: list[float | None]) -> str:
    """Mean seconds to the SVM over the seeds that reached it, and how many did when not all."""
    reached = [t for t in times if t is not None]
    if not reached:
        return "never"
    text = f"{statistics.fmean(reached):.1f}"
    return text if len(reached) == len(times) else f"{text} ({len(reached)}/{len(times)})"


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _print_seed(scene: str, protocol: str, seed: int, method: str, s: Score) -> None:
    reached = "never" if s.to_svm is None else f"{s.to_svm:.1f} s"
    to_svm = "" if method.startswith("RBF") else f"  to SVM {reached}"
    print(
        f"  seed {seed} {scene} {protocol} {method}: OA {100 * s.oa:.2f} % AA {100 * s.aa:.2f} % "
        f"kappa {s.kappa:.3f} in {s.seconds:.1f} s{to_svm}{'  ' + s.note if s.note else ''}",
        flush=True,
    )


def _print_table(title: str, results: dict[tuple[str, str, str, str], list[Score]]) -> None:
    print(
        f"\n{title}\n{'scene':32} {'split':11} {'method':40} {'seeds':>5} {'OA % (mean ± sd)':>17} {'min OA':>6} "
        f"{'AA %':>6} {'kappa':>6} {'wall s':>7} {'to SVM s':>10}  note"
    )
    for (scene, protocol, _, method), scores in results.items():  # a recipe's row, then the SVMs on its splits
        oa = [100 * s.oa for s in scores]
        to_svm = "-" if method.startswith("RBF") else _to_svm_text([s.to_svm for s in scores])
        notes = sorted({s.note for s in scores if s.note and not method.startswith("RBF")})
        print(
            f"{scene:32} {protocol:11} {method:40} {len(scores):5d} {statistics.fmean(oa):8.2f} ± {_spread(oa):5.2f} "
            f"{min(oa):6.2f} {100 * statistics.fmean(s.aa for s in scores):6.2f} "
            f"{statistics.fmean(s.kappa for s in scores):6.3f} {statistics.fmean(s.seconds for s in scores):7.1f} "
            f"{to_svm:>10}  {', '.join(notes)}",
            flush=True,
        )


def main() -> int:
    """Run every (recipe, protocol, seed) and its SVMs; print each run, the table of means and the count of wins."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, help="folder of the real scenes (default: hslite fit's data root)")
    parser.add_argument("--recipes", nargs="+", help="default: every shipped one-device recipe")
    parser.add_argument("--protocols", nargs="+", default=["stratified"], choices=("stratified", "disjoint"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed of each run (default: 0)")
    parser.add_argument("--max-epochs", type=int, help="cap every recipe's epochs (a quick pass; rows say so)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every fit (noted)")
    parser.add_argument(
        "--stand-ins-too",
        action="store_true",
        help="also run each real scene's synthetic stand-in and print the two side by side",
    )
    args = parser.parse_args()
    from hslite.datasets.scenes.registry import default_data_root, is_synthetic, list_scenes

    data_root = (args.data_root or default_data_root()).resolve()
    # A disjoint split's test blocks can lack a class an SVM still predicts: balanced accuracy is then over the classes
    # present, as the recipes' AA is, and scikit-learn's warning says only that.
    warnings.filterwarnings("ignore", "y_pred contains classes not in y_true")

    # keyed by recipe too: recipes of one scene may split it differently (patch margins), so each has its own SVMs
    results: dict[tuple[str, str, str, str], list[Score]] = defaultdict(list)
    pairs: list[tuple[tuple[str, str, str, str], ...]] = []
    with tempfile.TemporaryDirectory(prefix="hslite-tta-") as tmp:
        for i, recipe in enumerate(args.recipes or _one_device_recipes()):
            scene, why = _scene_to_run(recipe, data_root)
            if scene is None:
                print(f"skipped {recipe}: {why}", flush=True)
                continue
            scenes = [(scene, why)]
            if args.stand_ins_too and f"synthetic_{scene}" in list_scenes():
                scenes.append((f"synthetic_{scene}", "synthetic stand-in"))
            capped = [f"train.max_epochs={args.max_epochs}"] if args.max_epochs else []
            for (scene, why), protocol in itertools.product(scenes, args.protocols):
                note = ", ".join(filter(None, [why, *args.set]))
                if args.max_epochs:
                    note = ", ".join(filter(None, [note, f"capped at {args.max_epochs} epochs"]))
                ours = (scene, protocol, recipe, f"hslite {recipe}")
                pairs.append((ours, *((scene, protocol, recipe, method) for method in SVM_METHODS)))
                for seed in args.seeds:
                    overrides = [f"train.seed={seed}", *args.set, *capped]
                    work = Path(tmp) / f"{i}-{scene}-{protocol}-{seed}"
                    run = _fit(recipe, scene, protocol, overrides, data_root, work)
                    svms = [_svm(run, with_mean) for with_mean in (False, True)]
                    score = _recipe_score(run, max(val_oa for _, val_oa in svms), note)
                    for method, result in ((ours[3], score), *zip(SVM_METHODS, (s for s, _ in svms), strict=True)):
                        results[(scene, protocol, recipe, method)].append(result)
                        _print_seed(scene, protocol, seed, method, result)
    if not pairs:
        print("no recipe ran: pass --data-root or --recipes of a synthetic scene")
        return 1
    lines: list[str] = []
    for label, real in (("stand-ins", False), ("real scenes", True)):
        kept = [keys for keys in pairs if is_synthetic(keys[0][0]) != real]
        if not kept:
            continue
        _print_table(f"{label}:", {key: results[key] for keys in kept for key in keys})
        margins = []
        for ours, *baselines in kept:
            mean = {key: round(100 * statistics.fmean(s.oa for s in results[key]), 2) for key in (ours, *baselines)}
            margins.append(mean[ours] - max(mean[key] for key in baselines))
        lines.append(
            f"{label}: worst margin over the better SVM: {min(margins):+.2f} OA points "
            f"(means over {len(args.seeds)} seeds)\n"
            f"{label}: recipes at or above the better SVM: {sum(m >= 0 for m in margins)} of {len(margins)}"
        )
    print("\n" + "\n".join(lines))
    if args.stand_ins_too:
        _print_stand_ins_against_real(results)
    return 0


def _print_stand_ins_against_real(results: dict[tuple[str, str, str, str], list[Score]]) -> None:
    """Each real scene's mean OA beside its stand-in's, per recipe, protocol and method, and how many agree."""
    print(
        f"\nstand-in against real scene:\n{'recipe':28} {'split':11} {'method':40} {'real OA %':>9} "
        f"{'stand-in':>9} {'diff':>6}"
    )
    within = []
    for (scene, protocol, recipe, method), scores in results.items():
        stand_in = results.get((f"synthetic_{scene}", protocol, recipe, method))
        if not stand_in:
            continue
        real_oa, stand_in_oa = (100 * statistics.fmean(s.oa for s in r) for r in (scores, stand_in))
        within.append(abs(stand_in_oa - real_oa) <= STAND_IN_TOLERANCE)
        print(f"{recipe:28} {protocol:11} {method:40} {real_oa:9.2f} {stand_in_oa:9.2f} {stand_in_oa - real_oa:+6.2f}")
    print(f"stand-ins within ±{STAND_IN_TOLERANCE:g} OA points of their real scene: {sum(within)} of {len(within)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
