"""`hslite compare`: rows side by side, each with its pre-flight prediction and, on request, a short real fit.

    hslite compare recipes=compare_cpu_*                                  # predictions on this box
    hslite compare recipes=compare_cpu_* measure=true steps=30 auto=compare_cpu_1proc
    hslite compare rows=matrix.yaml measure=true                          # a row per plan, no recipe file per row
    hslite compare recipes=indian_pines_4gpu,indian_pines_8gpu preflight.topology=nvlink_8 preflight.device=h100_sxm

    options = CompareOptions([RowSpec("dp2 b16", "quickstart_cpu2", ["data.batch_size=16"])], measure=True)
    rows, folder = run_compare(options)                                   # the same from Python

Every other key=value applies to every row, before the row's own overrides (rows.py). Without measure=true each row
is its pre-flight (`check_recipe`; for parallel.plan=auto, the plan `choose_plan` picks). With measure=true each row
is one `hslite fit` in a process of its own (a clean allocator and thread state for every plan; MEASURE_OVERRIDES
make it short: steps + WARMUP_STEPS optimiser steps, one validation and one test batch, no map, no checkpoint, and
the pre-flight on but not enforced, so a NO-GO plan is measured too: compare is for ranking). The row's prediction is
the pre-flight that fit ran before training and its measurement is what fit measured (metrics.json, preflight.json),
so what is compared is exactly what `hslite fit` runs. `auto=RECIPE` adds RECIPE under parallel.plan=auto.

Measured efficiency is docs/design.md's E: a row's measured ECD over the best measured one-device row of the same work
(rows that differ only in name and layout at one global batch). Each multi-device row's pre-flight priced its E
against a best single-device plan; when no row is that plan, a "<label> (reference)" row fits it (unless
reference=false), so every measured E has the reference its verdict had, and `verdict_holds` says whether the verdict
(GO ⇔ E ≥ the verdict's own preflight.min_efficiency) agreed with the measurement.
A row that fails (a plan the box or model refuses, a crash) becomes a failed row with its error; the others run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from hslite.comparison.chag_rule import judge_channel_groups
from hslite.comparison.report import write_reports
from hslite.comparison.rows import REFERENCE_SUFFIX, CompareOptions, CompareRow, check_labels
from hslite.errors import ConfigError, HSLiteError
from hslite.parallel.plan import Plan
from hslite.preflight_check.price.candidates import candidate_plans
from hslite.recipe.config import load_config
from hslite.recipe.schema import Config, ParallelConfig
from hslite.run.folder import RunFolder

WARMUP_STEPS = 2  # before them: lazy initialisation, DDP's first single-bucket step, the optimiser state's allocation
MEASURE_OVERRIDES = (
    "train.progress=false",
    "output.save_map=false",
    "preflight.enabled=true",  # the prediction of a measured row is the pre-flight fit runs before training
    "preflight.enforce=false",
)
SHORT_OVERRIDES = (  # a timed run, not a training: every row but accuracy=true's
    "train.max_epochs=1000000",  # train.max_steps ends the run, however few batches an epoch has
    "train.limit_val_batches=1",
    "train.limit_test_batches=1",
    "output.save_checkpoint=false",
    "train.refit=false",  # a row is timed on its first training: a refit would train it all again
)


class _Entry(NamedTuple):
    """A row ready to run: its label, recipe, every override it gets (shared, then its own) and the loaded config."""

    label: str
    recipe: str
    overrides: list[str]
    cfg: Config  # with MEASURE_OVERRIDES when measuring: the config its fit trains


def run_compare(
    options: CompareOptions, progress: Callable[[str], None] | None = None
) -> tuple[list[CompareRow], Path]:
    """Predict (and measure) every row; write compare.csv/json/png under <output.root>/compare/<stamp>/."""
    if not options.rows:
        raise ConfigError("CompareOptions.rows is empty: give at least one RowSpec(label, recipe, overrides).")
    say = progress or (lambda line: None)
    # usage errors surface here, before any work
    entries = [_entry(row.label, row.recipe, [*options.overrides, *row.overrides], options) for row in options.rows]
    check_labels([entry.label for entry in entries])
    with RunFolder(Path(entries[0].cfg.output.root) / "compare") as run:
        rows = []
        for index, entry in enumerate(entries):
            say(f"[{index + 1}/{len(entries)}] {entry.label}: {'measuring' if options.measure else 'predicting'}")
            rows.append(_measured(entry, index, run.path, options) if options.measure else _predicted(entry))
        if options.measure and options.reference:
            for entry in _references(entries, rows, run.path, options):
                say(f"[reference] {entry.label}: measuring")
                rows.append(_measured(entry, len(entries), run.path, options))
                entries.append(entry)
        measured = [row.measured_ecd is not None for row in rows]
        workloads = [_workload(e.cfg) if done else None for e, done in zip(entries, measured, strict=True)]
        _relate(rows, workloads)
        judge_channel_groups(rows, workloads)
        write_reports(run.path, rows, options)
    return rows, run.path


def run_overrides(options: CompareOptions) -> list[str]:
    """What a measured row's fit gets after its own overrides: short and timed, or (accuracy=true) trained through."""
    if not options.measure:
        return []
    return [*MEASURE_OVERRIDES] if options.accuracy else [*MEASURE_OVERRIDES, *SHORT_OVERRIDES]


def _entry(label: str | None, recipe: str, overrides: list[str], options: CompareOptions) -> _Entry:
    try:
        cfg = load_config(recipe, [*overrides, *run_overrides(options)])
    except ConfigError as err:
        if label is None:  # a recipes= row: the error names its recipe already
            raise
        raise ConfigError(f"row {label!r}: {err}") from None
    return _Entry(label or cfg.recipe + (" (auto)" if cfg.parallel.plan == "auto" else ""), recipe, overrides, cfg)


def _predicted(entry: _Entry) -> CompareRow:
    from hslite.recipe.auto_plan import choose_plan
    from hslite.recipe.gate import check_recipe

    cfg = entry.cfg
    row = CompareRow(entry.label, auto=cfg.parallel.plan == "auto")
    try:
        verdict = choose_plan(cfg).verdict if cfg.parallel.plan == "auto" else check_recipe(cfg)
    except HSLiteError as err:
        row.failure = str(err)
        return row
    row.add_prediction(verdict.to_dict())
    return row


def _measured(entry: _Entry, index: int, folder: Path, options: CompareOptions) -> CompareRow:
    # A folder per row: several rows may share a recipe, and fit writes <output.root>/<recipe>/<stamp>.
    slug = f"{index + 1:02d}-" + re.sub(r"[^\w.-]+", "-", entry.label).strip("-")
    root, log = folder / "runs" / slug, folder / "logs" / f"{slug}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "hslite.cli", "fit", f"recipe={entry.recipe}", *entry.overrides]
    command += [*run_overrides(options), f"output.root={root}"]
    command += [] if options.accuracy else [f"train.max_steps={options.steps + WARMUP_STEPS}"]
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    row = CompareRow(entry.label, auto=entry.cfg.parallel.plan == "auto")
    finished = [d for d in (root / entry.cfg.recipe).glob("*") if d.is_dir() and "." not in d.name]
    if code != 0 or not finished:
        row.failure = f"{_last_error(log)} (exit {code}; log: {log.relative_to(folder)})"
        return row
    (run_dir,) = finished
    metrics = json.loads((run_dir / "metrics.json").read_text())
    report = json.loads((run_dir / "preflight.json").read_text())
    row.add_prediction(report)
    row.add_measurement(report, metrics, whole=options.accuracy)
    row.run_dir = str(run_dir.relative_to(folder))  # the compare folder is renamed when it completes
    return row


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("hslite: error: ") for line in lines if line.startswith("hslite: error:")]
    return (errors or lines or ["no output"])[-1]


def _workload(cfg: Config) -> str:
    """What a row trains, less its name and layout but with its global batch: rows alike here share one reference.

    Rotation stays in: a rotating row trains a subset of band groups per step, less work than the same model without.
    """
    from hslite.recipe.build import plan_from_config

    plan = plan_from_config(cfg)
    return repr(
        replace(
            cfg,
            recipe="",
            description="",
            data=replace(cfg.data, batch_size=plan.global_batch),
            parallel=ParallelConfig(accelerator=plan.accelerator, rotation_groups=plan.rotation_groups),
        )
    )


def _best_single_plan(report: dict[str, Any]) -> Plan:
    """The plan a pre-flight report priced efficiency against, as a Plan (the report names it).

    A single device as a rule; the fewest devices that hold the model where one cannot (`verdict._reference`).
    """
    requested = Plan(**report["requested_plan"])
    # the fewest devices that hold the model may be more than were requested: every count the pre-flight prices
    candidates = candidate_plans(requested, max_devices=16, chag_supported=True, include_fsdp=True, down_to_one=True)
    return next(plan for plan in candidates if plan.describe() == report["best_single"])


def _references(entries: list[_Entry], rows: list[CompareRow], folder: Path, options: CompareOptions) -> list[_Entry]:
    """A row for each measured multi-device row's best single-device plan (its pre-flight's) that no row is."""
    have = {(_workload(e.cfg), row.plan) for e, row in zip(entries, rows, strict=True) if row.world_size == 1}
    added = []
    for entry, row in zip(entries, rows, strict=True):
        if row.measured_ecd is None or row.world_size == 1 or row.best_single is None:
            continue
        key = (_workload(entry.cfg), row.best_single)
        if key in have:
            continue
        have.add(key)
        plan = _best_single_plan(json.loads((folder / str(row.run_dir) / "preflight.json").read_text()))
        # Plan.overrides() is how auto_plan asks `hslite fit` for a plan; manual: an auto row's reference trains it
        overrides = [*entry.overrides, *plan.overrides().split(), "parallel.plan=manual"]
        added.append(_entry(entry.label + REFERENCE_SUFFIX, entry.recipe, overrides, options))
    return added


def _relate(rows: list[CompareRow], workloads: list[str | None]) -> None:
    """Each measured row's E against the best measured one-device row of its work, and whether its verdict held."""
    pairs = zip(rows, workloads, strict=True)
    measured = [
        (row, work, row.measured_ecd) for row, work in pairs if work is not None and row.measured_ecd is not None
    ]
    for row, work, ecd in measured:
        singles = [(other_ecd, other.label) for other, w, other_ecd in measured if w == work and other.world_size == 1]
        if singles:
            best_ecd, row.reference = max(singles)
            row.measured_efficiency = ecd / best_ecd
            row.judge_verdict()
