"""What `hslite compare` writes and prints: compare.csv, compare.json, compare.png and a rich table."""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from hslite.preflight_check.decide.verdict import gib
from hslite.run.outputs import write_json

if TYPE_CHECKING:
    from hslite.comparison.rows import CompareOptions, CompareRow

BYTES_NOTE = (
    "comm_bytes_per_step: bytes one rank sends per optimiser step; 'counted' from the tensors hslite hands to "
    "collectives (int8 hook, channel-group token exchange, band groups' own gradients), 'computed' with the ring "
    "formula (docs/design.md; plain DDP's gradient all-reduce, the bf16/fp16 hooks, FSDP's gathers and reduce-scatter)"
)


def median_abs_error(rows: list[CompareRow]) -> float | None:
    """Median of |predicted − measured| / measured step time over the measured rows; None when none was measured."""
    errors = [abs(row.error) for row in rows if row.error is not None]
    return statistics.median(errors) if errors else None


def verdict_tally(rows: list[CompareRow]) -> tuple[int, int, list[float]]:
    """(rows whose verdict held, rows whose verdict was checked, the thresholds those verdicts used)."""
    checked = [row for row in rows if row.verdict_holds is not None]
    thresholds = sorted({row.min_efficiency for row in checked if row.min_efficiency is not None})
    return sum(bool(row.verdict_holds) for row in checked), len(checked), thresholds


def summary_line(rows: list[CompareRow]) -> str:
    """A measured comparison in one line: the median step-time error and how many verdicts the measurement bore out."""
    median = median_abs_error(rows)
    line = "median prediction error: " + ("n/a (no plan was measured)" if median is None else f"{median:.0%}")
    held, checked, thresholds = verdict_tally(rows)
    if not checked:
        return line + "; no multi-device row's verdict could be checked"
    threshold = "/".join(f"{value:g}" for value in thresholds)
    return line + f"; verdict held on {held} of {checked} multi-device rows (GO iff measured E ≥ {threshold})"


def write_reports(folder: Path, rows: list[CompareRow], options: CompareOptions) -> None:
    """compare.csv (one line per row), compare.json (the same with the settings) and compare.png."""
    with (folder / "compare.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=[f.name for f in fields(rows[0])])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    write_json(folder / "compare.json", compare_json(rows, options))
    plot_compare(folder / "compare.png", rows)


def compare_json(rows: list[CompareRow], options: CompareOptions) -> dict[str, Any]:
    """The comparison as one JSON document (compare.json; --json prints it with the folder)."""
    held, checked, _ = verdict_tally(rows)
    return {
        "options": asdict(options),
        "median_abs_error": median_abs_error(rows),
        "verdicts_held": held,
        "verdicts_checked": checked,
        "memory_methods": sorted({row.memory_method for row in rows if row.memory_method}),
        "bytes_note": BYTES_NOTE,
        "rows": [asdict(row) for row in rows],
    }


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.3g}"


def _num(value: float | None, spec: str = ".4g") -> str:
    return "—" if value is None else format(value, spec)


def _bytes(value: float | None) -> str:
    return "—" if value is None else gib(value)


def render_table(rows: list[CompareRow], measured: bool) -> Table:
    """Rows side by side; measured columns only when the runs were measured."""
    table = Table(title="hslite compare" + (" (predicted vs measured)" if measured else " (predicted)"))
    columns = ["row", "plan", "pre-flight", "step ms"]
    if measured:
        columns += ["meas ms", "error", "samples/s", "ECD", "meas ECD", "E", "E meas", "holds"]
        columns += ["mem/device", "meas mem", "comm/step"]
    else:
        columns += ["samples/s", "ECD", "E", "mem/device"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("row", "plan") else "right")
    for row in rows:
        if row.failure and row.plan is None:
            table.add_row(row.label, f"[red]failed:[/red] {row.failure}", *["—"] * (len(columns) - 2))
            continue
        cells = [row.label, row.plan or "—", row.decision or "—", _ms(row.predicted_step_seconds)]
        if measured:
            comm = "—" if row.comm_bytes_per_step is None else f"{gib(row.comm_bytes_per_step)} {row.comm_bytes_source}"
            cells += [_ms(row.measured_step_seconds), _num(row.error, "+.0%"), _num(row.measured_samples_per_second)]
            holds = "—" if row.verdict_holds is None else ("yes" if row.verdict_holds else "no")
            cells += [_num(row.predicted_ecd), _num(row.measured_ecd), _num(row.predicted_efficiency, ".2f")]
            cells += [_num(row.measured_efficiency, ".2f"), holds]
            cells += [_bytes(row.predicted_memory_bytes), _bytes(row.measured_memory_bytes), comm]
        else:
            cells += [_num(row.predicted_samples_per_second), _num(row.predicted_ecd)]
            cells += [_num(row.predicted_efficiency, ".2f"), _bytes(row.predicted_memory_bytes)]
        table.add_row(*cells)
    return table


def print_table(rows: list[CompareRow], measured: bool) -> None:
    """The table on stdout, as wide as it needs in a log or a pipe."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log or a pipe: rich's 80 columns would fold every row of the wide table
        console = Console(width=400)  # a table is only as wide as its cells: this is room, not padding
    console.print(render_table(rows, measured))


def print_compare(rows: list[CompareRow], options: CompareOptions, folder: Path, as_json: bool = False) -> None:
    """The table, the summary line (measure=true) and where the files are; or the JSON alone."""
    if as_json:
        print(json.dumps({"folder": str(folder), **compare_json(rows, options)}, indent=2, default=str))
        return
    print_table(rows, options.measure)
    if options.measure:
        print(summary_line(rows))
    for row in rows:
        if row.chag_rule:
            print(f"channel groups, {row.label}: {row.chag_rule}")
    print(f"written: {folder}/compare.csv, compare.json, compare.png")


def plot_compare(path: Path, rows: list[CompareRow]) -> None:
    """Per row: predicted vs measured ECD, and predicted vs measured memory per device, bars side by side."""
    import numpy as np
    from matplotlib.figure import Figure  # not pyplot: its backend and figure list are the caller's

    def values(name: str, scale: float = 1.0) -> np.ndarray:
        return np.array([math.nan if getattr(r, name) is None else getattr(r, name) / scale for r in rows])

    # An auto row's plan is not in its recipe's name, so it is written under it.
    labels = [row.label + (f"\n{row.plan}" if row.auto and row.plan else "") for row in rows]
    labels = [label + ("\n(failed)" if row.failure else "") for label, row in zip(labels, rows, strict=True)]
    x, width = np.arange(len(rows)), 0.38
    measured = any(row.measured_step_seconds is not None for row in rows)
    fig = Figure(figsize=(max(9.0, 1.5 * len(rows) + 4), 5.2))
    axes = fig.subplots(1, 2)
    panels = (
        (axes[0], "ecd", 1.0, "samples/s per device (ECD)", "throughput per device"),
        (axes[1], "memory_bytes", 2**20, "peak memory per device (MiB)", "memory per device"),
    )
    for ax, name, scale, ylabel, title in panels:
        offset = width / 2 if measured else 0.0
        ax.bar(x - offset, values(f"predicted_{name}", scale), width, label="predicted (pre-flight)", color="#8da0cb")
        if measured:
            ax.bar(x + offset, values(f"measured_{name}", scale), width, label="measured (short fit)", color="#fc8d62")
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.margins(y=0.2)  # headroom, so the legend never covers a bar
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    methods = sorted({row.memory_method for row in rows if row.memory_method})
    if methods:
        fig.text(0.01, 0.01, "measured memory: " + "; ".join(methods), fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05 if methods else 0, 1, 1))
    fig.savefig(path, dpi=120)
