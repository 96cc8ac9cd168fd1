"""Host memory and time of `hslite fit` and `hslite predict` against the size of a scene of your own.

    python benchmarks/scene_scaling.py                                  # 0.25, 0.5, 1 and 2 GB cubes
    python benchmarks/scene_scaling.py --sizes-gb 0.25 1 4 --folder /scratch/cubes
    python benchmarks/scene_scaling.py --model cnn3d --patch-size 5 --pca 20 --epochs 1
    python benchmarks/scene_scaling.py --on-disk                        # data.on_disk=true
    python benchmarks/scene_scaling.py --sizes-gb 2 --repeat 3          # each figure the worst of 3 runs

Each size is a square float32 `.npy` cube of `--bands` bands with a 2 %-labelled label map
(`hslite.datasets.scenes.synthetic.write_large_scene`, written a block at a time into --folder and deleted afterwards),
trained as a team would try its own flightline: `hslite fit data.scene=cube.npy data.labels=gt.npy ...` (test and the
whole-scene map included), then mapped again with `hslite predict run=... cube=cube.npy`. Every command runs in a
fresh process; its peak resident set is the one the kernel reports for that process (os.wait4), its wall time is
measured around it, and the training time is the run's own (metrics.json `train_seconds`). With `--repeat K` both
commands run K times on the same cube and each figure of the row is the worst of the K (the largest peak, the
longest time): a peak that holds on one run in three is not a peak a team can plan a machine by.

A row per size, then how peak memory grows with the cube (a least-squares line: the constant is the interpreter,
torch and Lightning), and last: the largest cube's peak RSS (the larger of fit and predict) over its size, and its
fit + predict time per GB over the smallest cube's (1.0 is linear; below 1, the fixed start-up weighs less).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GB = 1e9


def run_measured(command: list[str], log: Path) -> tuple[float, float]:
    """Run `command` in a fresh process (output to `log`); return (wall seconds, peak RSS bytes) of that process."""
    started = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {child.returncode}; its output is in {log}:\n{log.read_text()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024.0  # ru_maxrss is in KiB on Linux


def write_cube(size_gb: float, folder: Path, args: argparse.Namespace) -> tuple[Path, Path, int]:
    """Write a square cube of about `size_gb` and its label map into `folder`; return their paths and the side."""
    side = int(math.sqrt(size_gb * GB / (4 * args.bands)))
    cube, labels = folder / "cube.npy", folder / "gt.npy"
    # In a process of its own: a child's peak RSS starts from its parent's peak (Linux keeps the larger at exec, and
    # subprocess's vfork shares the parent's memory until then), and writing maps the whole cube.
    write = (
        "import sys; from hslite.datasets.scenes.synthetic import write_large_scene as w; "
        "w(sys.argv[1], sys.argv[2], (int(sys.argv[3]),) * 2 + (int(sys.argv[4]),), float(sys.argv[5]))"
    )
    subprocess.run(
        [sys.executable, "-c", write, str(cube), str(labels), str(side), str(args.bands), str(args.labelled_fraction)],
        check=True,
    )
    return cube, labels, side


def measure(cube: Path, labels: Path, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """Fit and predict once on the cube; its seconds and peak RSS."""
    runs = folder / "runs"
    hslite = [sys.executable, "-m", "hslite.cli"]
    fit_seconds, fit_rss = run_measured(
        [
            *hslite, "fit", f"data.scene={cube}", f"data.labels={labels}", f"model.name={args.model}",
            f"data.patch_size={args.patch_size}", f"data.pca_components={args.pca}", f"train.max_epochs={args.epochs}",
            f"output.root={runs}", "train.progress=false", f"data.on_disk={str(args.on_disk).lower()}",
        ],
        folder / "fit.log",
    )  # fmt: skip
    run = max(runs.glob("*/*/metrics.json"), key=lambda p: p.stat().st_mtime).parent
    train_seconds = json.loads((run / "metrics.json").read_text())["train_seconds"]
    predict_seconds, predict_rss = run_measured(
        [*hslite, "predict", f"run={run}", f"cube={cube}", "progress=false"], folder / "predict.log"
    )
    shutil.rmtree(runs)
    return {
        "fit_seconds": fit_seconds, "train_seconds": train_seconds, "fit_rss": fit_rss,
        "predict_seconds": predict_seconds, "predict_rss": predict_rss,
    }  # fmt: skip


def measure_worst(size_gb: float, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """Write a cube of about `size_gb`, fit and predict on it `args.repeat` times; the row: each figure's worst."""
    cube, labels, side = write_cube(size_gb, folder, args)
    try:
        runs = [measure(cube, labels, folder, args) for _ in range(args.repeat)]
        cube_bytes = float(cube.stat().st_size)
    finally:
        cube.unlink()
        labels.unlink()
    return {"cube_bytes": cube_bytes, "side": side, **{key: max(run[key] for run in runs) for key in runs[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="cube sizes, GB")
    parser.add_argument("--bands", type=int, default=200, help="bands of each cube (an EnMAP tile has about 230)")
    parser.add_argument("--labelled-fraction", type=float, default=0.02, help="share of pixels with a label")
    parser.add_argument("--model", default="cnn1d", help="model.name of the fit")
    parser.add_argument("--patch-size", type=int, default=1, help="data.patch_size of the fit")
    parser.add_argument("--pca", type=int, default=0, help="data.pca_components of the fit; 0 means off")
    parser.add_argument("--epochs", type=int, default=3, help="train.max_epochs of the fit")
    parser.add_argument("--on-disk", action="store_true", help="data.on_disk=true: hold the labelled patches only")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each command per cube; a row shows the worst")
    parser.add_argument("--folder", type=Path, default=None, help="where cubes are written; default a temporary one")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: each command runs at least once; give 1 or more")
    folder = Path(tempfile.mkdtemp(prefix="scene_scaling_", dir=args.folder))
    held = "labelled patches held (data.on_disk)" if args.on_disk else "padded scene held"
    plan = f"{args.model}, patch {args.patch_size}, PCA {args.pca or 'off'}, {args.epochs} epoch(s), {args.bands} bands"
    worst = f", each figure the worst of {args.repeat} runs" if args.repeat > 1 else ""
    print(f"{plan}, {held}{worst}")
    header = f"{'cube GB':>8} {'pixels':>11} {'fit s':>7} {'train s':>8} {'fit RSS GB':>11} {'×cube':>6}"
    print(header + f" {'predict s':>10} {'predict RSS GB':>15} {'×cube':>6}", flush=True)
    rows = []
    try:
        for size in sorted(args.sizes_gb):
            row = measure_worst(size, folder, args)
            rows.append(row)
            gb = row["cube_bytes"] / GB
            print(
                f"{gb:8.2f} {row['side']:>5}×{row['side']:<5} {row['fit_seconds']:7.1f} {row['train_seconds']:8.1f} "
                f"{row['fit_rss'] / GB:11.2f} {row['fit_rss'] / row['cube_bytes']:6.2f} "
                f"{row['predict_seconds']:10.1f} {row['predict_rss'] / GB:15.2f} "
                f"{row['predict_rss'] / row['cube_bytes']:6.2f}",
                flush=True,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    sizes = np.array([row["cube_bytes"] for row in rows])
    for command in ("fit", "predict"):
        if len(rows) > 1:
            slope, constant = np.polyfit(sizes, [row[f"{command}_rss"] for row in rows], 1)
            print(f"{command} peak RSS ≈ {constant / GB:.2f} GB + {slope:.2f} × the cube (least squares)")
    small, large = rows[0], rows[-1]
    peak = max(large["fit_rss"], large["predict_rss"]) / large["cube_bytes"]
    per_byte = [(row["fit_seconds"] + row["predict_seconds"]) / row["cube_bytes"] for row in (small, large)]
    print(f"largest cube: peak RSS {peak:.2f}× the cube, time {per_byte[1] / per_byte[0]:.2f}× linear")


if __name__ == "__main__":
    main()
