"""`hslite compare`: recipes side by side, each with its pre-flight prediction and, on request, a short real fit.

    hslite compare recipes=compare_cpu_*                                  # predictions on this box
    hslite compare recipes=compare_cpu_* measure=true steps=30 auto=compare_cpu_1proc
    hslite compare recipes=indian_pines_4gpu,indian_pines_8gpu preflight.topology=nvlink_8 preflight.device=h100_sxm

Every other key=value applies to every recipe. Without measure=true each row is the recipe's pre-flight
(`check_recipe`; for parallel.plan=auto, the plan `choose_plan` picks). With measure=true each row is one
`hslite fit` in a process of its own (a clean allocator and thread state for every plan; MEASURE_OVERRIDES make it
short: steps + WARMUP_STEPS optimiser steps, one validation and one test batch, no map, no checkpoint, and the
pre-flight on but not enforced, so a NO-GO plan is measured too: compare is for ranking). The row's prediction is the
pre-flight that fit ran before training and its measurement is what fit measured (metrics.json, preflight.json), so
what is compared is exactly what `hslite fit` runs. `auto=RECIPE` adds RECIPE under parallel.plan=auto.
A recipe that fails (a plan the box or model refuses, a crash) becomes a failed row with its error; the others run.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hslite.compare.report import write_reports
from hslite.errors import ConfigError, HSLiteError
from hslite.parallel.plan import Plan
from hslite.recipe.config import Config, list_recipes, load_config, parse_overrides
from hslite.run.folder import RunFolder

OPTION_KEYS = ("recipes", "measure", "steps", "auto")
DEFAULT_STEPS = 30  # timed optimiser steps per measured run: a median of 30 settles within a few percent here
WARMUP_STEPS = 2  # before them: lazy initialisation, DDP's first single-bucket step, the optimiser state's allocation
MEASURE_OVERRIDES = (
    "train.max_epochs=1000000",  # train.max_steps ends the run, however few batches an epoch has
    "train.limit_val_batches=1",
    "train.limit_test_batches=1",
    "train.progress=false",
    "output.save_map=false",
    "output.save_checkpoint=false",
    "preflight.enabled=true",  # the prediction of a measured row is the pre-flight fit runs before training
    "preflight.enforce=false",
)


@dataclass
class CompareOptions:
    """What `hslite compare` was asked: recipes, the overrides they share, and whether to measure."""

    recipes: list[str]
    overrides: list[str]
    measure: bool = False
    steps: int = DEFAULT_STEPS
    auto: str | None = None  # a recipe to add under parallel.plan=auto


@dataclass
class CompareRow:
    """One recipe's prediction and, when measured, its measurement; `failure` says why a row has neither."""

    label: str
    auto: bool = False  # the plan is parallel.plan=auto's choice, not the recipe's layout
    plan: str | None = None
    world_size: int | None = None
    global_batch: int | None = None
    decision: str | None = None  # the pre-flight's GO / NO-GO / UNDECIDED
    predicted_step_seconds: float | None = None
    measured_step_seconds: float | None = None
    error: float | None = None  # (predicted − measured) / measured step time
    predicted_samples_per_second: float | None = None
    measured_samples_per_second: float | None = None  # global batch / measured step
    predicted_ecd: float | None = None
    measured_ecd: float | None = None
    predicted_efficiency: float | None = None  # against the pre-flight's best single device
    measured_efficiency: float | None = None  # against the best measured 1-device row of this comparison
    predicted_memory_bytes: int | None = None
    measured_memory_bytes: int | None = None
    memory_method: str | None = None
    comm_bytes_per_step: float | None = None  # per rank
    comm_bytes_source: str | None = None  # "counted", "computed" or both (parallel/usage.py)
    run_dir: str | None = None  # the measured run, inside the compare folder
    failure: str | None = None

    def add_prediction(self, report: dict[str, Any]) -> None:
        """Fill the predicted columns from a pre-flight report (Verdict.to_dict, or a run's preflight.json)."""
        plan = Plan(**report["requested_plan"])
        prediction = report["requested_prediction"]
        self.plan, self.world_size, self.global_batch = plan.describe(), plan.world_size, plan.global_batch
        self.decision, self.predicted_efficiency = report["decision"], report["efficiency"]
        self.predicted_step_seconds = prediction.get("step_seconds")  # absent where compute was not priced
        self.predicted_samples_per_second = prediction.get("samples_per_second")
        self.predicted_ecd = prediction.get("ecd")
        self.predicted_memory_bytes = prediction["per_device_peak_bytes"]

    def add_measurement(self, report: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Fill the measured columns from a finished run's preflight.json and metrics.json."""
        plan, measured, usage = Plan(**report["requested_plan"]), report.get("measured"), metrics.get("usage", {})
        if measured is None:  # the compression guard changed the plan mid-run: no like-for-like step time
            self.failure = f"the plan changed during the run (ended as {metrics['plan_that_ran']}): not timed"
        else:
            self.measured_step_seconds, self.error = measured["step_seconds"], measured["relative_error"]
            self.measured_samples_per_second = plan.global_batch / measured["step_seconds"]
            self.measured_ecd = self.measured_samples_per_second / plan.world_size
        self.measured_memory_bytes, self.memory_method = usage.get("peak_memory_bytes"), usage.get("peak_memory_method")
        counted, computed = usage.get("counted_bytes_per_step") or 0.0, usage.get("computed_bytes_per_step") or 0.0
        if counted or computed:
            self.comm_bytes_per_step = counted + computed
            self.comm_bytes_source = " + ".join(name for name, n in (("counted", counted), ("computed", computed)) if n)


def parse_options(items: list[str]) -> CompareOptions:
    """Split `hslite compare`'s own keys (recipes, measure, steps, auto) from the overrides every recipe gets."""
    pairs = parse_overrides(items)
    own = {key: value for key, value in pairs if key in OPTION_KEYS}
    if any(key == "recipe" for key, _ in pairs):
        raise ConfigError("`hslite compare` takes recipes=A,B,... (a list), not recipe=.")
    if not own.get("recipes"):
        raise ConfigError(
            "`hslite compare` needs recipes=A,B,... (names, .yaml paths or patterns such as compare_cpu_*); "
            "see `hslite recipes`."
        )
    if own.get("measure", "false") not in ("true", "false"):
        raise ConfigError(f"measure must be true or false, got {own['measure']!r}.")
    steps = own.get("steps", str(DEFAULT_STEPS))
    if not steps.isdigit() or int(steps) < 1:
        raise ConfigError(f"steps must be a whole number ≥ 1 (timed optimiser steps per run), got {steps!r}.")
    return CompareOptions(
        recipes=_expand(own["recipes"]),
        overrides=[f"{key}={value}" for key, value in pairs if key not in OPTION_KEYS],
        measure=own.get("measure") == "true",
        steps=int(steps),
        auto=own.get("auto"),
    )


def _expand(listed: str) -> list[str]:
    names: list[str] = []
    for item in filter(None, (part.strip() for part in listed.split(","))):
        if not any(c in item for c in "*?["):
            names.append(item)
            continue
        matched = fnmatch.filter(sorted(list_recipes()), item)
        if not matched:
            raise ConfigError(f"no recipe matches {item!r}; see `hslite recipes`.")
        names += matched
    if not names:
        raise ConfigError(f"recipes={listed!r} names no recipe; list them as recipes=A,B,...")
    return list(dict.fromkeys(names))


def run_compare(
    options: CompareOptions, progress: Callable[[str], None] | None = None
) -> tuple[list[CompareRow], Path]:
    """Predict (and measure) every row; write compare.csv/json/png under <output.root>/compare/<stamp>/."""
    asked = [(name, options.overrides) for name in options.recipes]
    if options.auto:
        asked.append((options.auto, [*options.overrides, "parallel.plan=auto"]))
    entries: dict[str, tuple[str, list[str], Config]] = {}  # by label; usage errors surface here, before any work
    for recipe, overrides in asked:
        cfg = load_config(recipe, overrides)
        entries.setdefault(_label(cfg), (recipe, overrides, cfg))
    with RunFolder(Path(next(iter(entries.values()))[2].output.root) / "compare") as run:
        rows = []
        for index, (label, (recipe, overrides, cfg)) in enumerate(entries.items()):
            if progress is not None:
                progress(f"[{index + 1}/{len(entries)}] {label}: {'measuring' if options.measure else 'predicting'}")
            if options.measure:
                rows.append(_measured(recipe, overrides, cfg, run.path, options.steps))
            else:
                rows.append(_predicted(cfg))
        _relate(rows)
        write_reports(run.path, rows, options)
    return rows, run.path


def _label(cfg: Config) -> str:
    return cfg.recipe + (" (auto)" if cfg.parallel.plan == "auto" else "")


def _predicted(cfg: Config) -> CompareRow:
    from hslite.recipe.auto_plan import choose_plan
    from hslite.recipe.gate import check_recipe

    row = CompareRow(_label(cfg), auto=cfg.parallel.plan == "auto")
    try:
        verdict = choose_plan(cfg).verdict if cfg.parallel.plan == "auto" else check_recipe(cfg)
    except HSLiteError as err:
        row.failure = str(err)
        return row
    row.add_prediction(verdict.to_dict())
    return row


def _measured(recipe: str, overrides: list[str], cfg: Config, folder: Path, steps: int) -> CompareRow:
    auto = cfg.parallel.plan == "auto"
    slug = cfg.recipe + ("-auto" if auto else "")
    # fit writes <output.root>/<recipe>/<stamp>; the auto row of a recipe measured too gets a folder of its own
    root, log = folder / "runs" / ("auto" if auto else ""), folder / "logs" / f"{slug}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "hslite.cli", "fit", f"recipe={recipe}", *overrides, *MEASURE_OVERRIDES]
    command += [f"train.max_steps={steps + WARMUP_STEPS}", f"output.root={root}"]
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    row = CompareRow(_label(cfg), auto=auto)
    finished = [d for d in (root / cfg.recipe).glob("*") if d.is_dir() and "." not in d.name]
    if code != 0 or not finished:
        row.failure = f"{_last_error(log)} (exit {code}; log: {log.relative_to(folder)})"
        return row
    (run_dir,) = finished
    metrics = json.loads((run_dir / "metrics.json").read_text())
    report = json.loads((run_dir / "preflight.json").read_text())
    row.add_prediction(report)
    row.add_measurement(report, metrics)
    row.run_dir = str(run_dir.relative_to(folder))  # the compare folder is renamed when it completes
    return row


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("hslite: error: ") for line in lines if line.startswith("hslite: error:")]
    return (errors or lines or ["no output"])[-1]


def _relate(rows: list[CompareRow]) -> None:
    """Measured efficiency: each row's measured ECD over the best measured one-device row's (DESIGN §3's E)."""
    singles = [row.measured_ecd for row in rows if row.world_size == 1 and row.measured_ecd is not None]
    for row in rows:
        if singles and row.measured_ecd is not None:
            row.measured_efficiency = row.measured_ecd / max(singles)
