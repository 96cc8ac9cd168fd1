"""Run outputs a person opens: metrics.json, confusion.png, map.png and the georeferenced prediction.tif."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hslite.datasets.scenes.geotiff_out import write_geotiff
from hslite.datasets.scenes.registry import Scene, to_label_codes

MAP_DPI = 120  # map.png's resolution, dots per inch


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON atomically (temp file + rename), so a crash never leaves half a report."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def class_colours(num_classes: int) -> np.ndarray:
    """RGB in [0, 1] per class (index 0 = unlabelled, black), from qualitative colour maps."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"] if num_classes <= 20 else matplotlib.colormaps["gist_ncar"]
    colours = [cmap(i / max(1, (20 if num_classes <= 20 else num_classes) - 1))[:3] for i in range(num_classes)]
    return np.vstack([[0.0, 0.0, 0.0], np.asarray(colours)])


def plot_confusion(path: Path, confusion: np.ndarray, class_names: list[str]) -> None:
    """Row-normalised confusion matrix (recall per true class) with the counts annotated when it is small."""
    from matplotlib.figure import Figure  # not pyplot: its backend and figure list are the caller's

    counts = np.asarray(confusion, dtype=np.int64)
    recall = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    size = max(4.0, 0.45 * len(class_names) + 2)
    fig = Figure(figsize=(size + 1, size))
    ax = fig.subplots()
    image = ax.imshow(recall, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(class_names)), class_names, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(class_names)), class_names, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if len(class_names) <= 16:
        for (i, j), n in np.ndenumerate(counts):
            if n:
                colour = "white" if recall[i, j] > 0.5 else "black"
                ax.text(j, i, str(n), ha="center", va="center", fontsize=6, color=colour)
    fig.colorbar(image, ax=ax, fraction=0.046, label="share of true class")
    ax.set_title("test confusion matrix")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_map(
    path: Path,
    predicted: np.ndarray,
    ground_truth: np.ndarray | None,
    class_names: list[str],
    label_codes: Sequence[int] | np.ndarray | None = None,
) -> None:
    """Predicted map of the whole scene beside the ground truth (when known), class colours and a legend.

    The legend numbers class i by `label_codes[i - 1]`, the code the label file and prediction.tif use, or by i.
    """
    from matplotlib.figure import Figure  # not pyplot: its backend and figure list are the caller's
    from matplotlib.patches import Patch

    colours = np.round(255 * class_colours(len(class_names))).astype(np.uint8)  # one byte a channel, not float64's 8
    panels = [(predicted, "prediction")]
    if ground_truth is not None:
        panels.insert(0, (ground_truth, "ground truth"))
    height, width = predicted.shape
    aspect = width / height
    figsize = (len(panels) * 4.5 * min(2.0, max(0.5, aspect)) + 2.5, 4.8)
    # A panel is drawn at most 2 × 4.5 inches wide: a larger map is shown by every step-th pixel, as nearest-neighbour
    # display would, so that matplotlib never holds RGBA copies of the whole scene (tens of bytes a pixel).
    step = max(1, -(-max(height, width) // int(2 * 4.5 * MAP_DPI)))
    fig = Figure(figsize=figsize)
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (labels, title) in zip(axes[0], panels, strict=True):
        ax.imshow(colours[labels[::step, ::step]], interpolation="nearest")
        ax.set_title(title)
        ax.set_axis_off()
    numbers = range(1, len(class_names) + 1) if label_codes is None else [int(code) for code in label_codes]
    legend = enumerate(zip(numbers, class_names, strict=True), start=1)
    handles = [Patch(color=colours[i] / 255, label=f"{number} {name}") for i, (number, name) in legend]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(path, dpi=MAP_DPI)


def summary_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """The lines of the end-of-run table."""
    rows = [
        ("overall accuracy (OA)", f"{100 * metrics['OA']:.2f}%"),
        ("average accuracy (AA)", f"{100 * metrics['AA']:.2f}%"),
        ("Cohen's kappa", f"{metrics['kappa']:.4f}"),
        ("epochs", str(metrics["epochs"])),
        ("train wall time", f"{metrics['train_seconds']:.1f} s"),
        ("training throughput", f"{metrics['train_samples_per_second']:.0f} samples/s"),
    ]
    return rows


def print_summary(metrics: dict[str, Any], run_dir: Path, class_names: list[str]) -> None:
    """Short table at the end of `hslite fit`."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hslite fit — {run_dir}", show_header=False)
    for key, value in summary_rows(metrics):
        table.add_row(key, value)
    per_class = metrics.get("per_class_accuracy", [])
    scored = [(acc, name) for acc, name in zip(per_class, class_names, strict=True) if acc is not None]
    worst = sorted(scored, key=lambda t: t[0])[:3]  # a class with no test pixel has no accuracy
    if worst:
        table.add_row("weakest classes", ", ".join(f"{name} {100 * acc:.1f}%" for acc, name in worst))
    Console().print(table)


def write_scene_outputs(
    folder: Path, confusion: np.ndarray, predicted: np.ndarray | None, scene: Scene, class_names: list[str]
) -> None:
    """confusion.png; with a whole-scene prediction (class indices, row-major) also map.png and prediction.tif.

    prediction.tif holds the scene's own label codes (an own scene's map is in its label file's codes) and its
    georeference.
    """
    plot_confusion(folder / "confusion.png", confusion, class_names)
    if predicted is None:
        return
    classes = predicted.reshape(scene.gt.shape) + 1
    plot_map(folder / "map.png", classes, scene.gt, class_names, scene.label_codes)
    write_geotiff(folder / "prediction.tif", to_label_codes(classes, scene.label_codes), scene.crs, scene.transform)
