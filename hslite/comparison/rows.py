"""What `hslite compare` is asked and what each of its rows holds: row specs, options, the rows file, result rows.

A row is a label, a recipe and the row's own overrides (after the ones every row shares), so a matrix of plans needs
no recipe file per row. From the command line, `recipes=A,B,...` gives one row per recipe and `rows=FILE.yaml` a
list of rows:

    - label: cnn1d dp2            # the table's first column; unique
      recipe: quickstart_cpu2     # a shipped recipe's name or a .yaml path
      overrides: [data.batch_size=32, parallel.precision=bf16-mixed]
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.recipe.config import list_recipes, parse_overrides

OPTION_KEYS = ("recipes", "rows", "measure", "steps", "auto", "reference", "accuracy")
DEFAULT_STEPS = 30  # timed optimiser steps per measured run: a median of 30 settles within a few percent here
REFERENCE_SUFFIX = " (reference)"  # the label of a row compare adds for a plan's best single device
ROW_KEYS = ("label", "recipe", "overrides")


@dataclass
class RowSpec:
    """One row to compare: a recipe with its own overrides, under a label."""

    label: str | None  # None: the recipe's name, with " (auto)" under parallel.plan=auto
    recipe: str  # a shipped recipe's name or a path to a .yaml file
    overrides: list[str] = field(default_factory=list)  # key=value, applied after the ones every row shares


@dataclass
class CompareOptions:
    """What `hslite compare` was asked: the rows, the overrides they share, and whether (and how long) to measure."""

    rows: list[RowSpec]
    overrides: list[str] = field(default_factory=list)  # every row's, before its own
    measure: bool = False
    steps: int = DEFAULT_STEPS
    # measure=true: fit each multi-device row's best single-device plan (its pre-flight's) when no row is that plan,
    # so that its measured efficiency has the reference its verdict was priced against; False leaves them out
    reference: bool = True
    # measure=true: every row trains its recipe's whole schedule (not `steps` steps) and reports its test OA, so the
    # channel-group rule (chag_rule.py) can check accuracy as well as speed
    accuracy: bool = False


@dataclass
class CompareRow:
    """One row's prediction and, when measured, its measurement; `failure` says why a row has neither."""

    label: str
    auto: bool = False  # the plan is parallel.plan=auto's choice, not the recipe's layout
    plan: str | None = None
    requested_plan: dict[str, Any] | None = None  # the Plan's fields, as preflight.json holds them
    world_size: int | None = None
    global_batch: int | None = None
    decision: str | None = None  # the pre-flight's GO / NO-GO / UNDECIDED
    min_efficiency: float | None = None  # the threshold that decision used (preflight.min_efficiency)
    best_single: str | None = None  # the single-device plan the pre-flight priced its efficiency against
    predicted_step_seconds: float | None = None
    measured_step_seconds: float | None = None
    error: float | None = None  # (predicted − measured) / measured step time
    predicted_samples_per_second: float | None = None
    measured_samples_per_second: float | None = None  # global batch / measured step
    predicted_ecd: float | None = None
    measured_ecd: float | None = None
    predicted_efficiency: float | None = None  # against the pre-flight's best single device
    measured_efficiency: float | None = None  # against `reference`
    reference: str | None = None  # the best measured one-device row of the same work (same model, data, global batch)
    verdict_holds: bool | None = None  # multi-device, measured: GO ⇔ measured_efficiency ≥ min_efficiency
    predicted_memory_bytes: int | None = None
    measured_memory_bytes: int | None = None
    memory_method: str | None = None
    comm_bytes_per_step: float | None = None  # per rank
    comm_bytes_source: str | None = None  # "counted", "computed" or both (parallel/usage.py)
    test_oa: float | None = None  # accuracy=true: the whole training's test overall accuracy
    plain_dp: str | None = None  # a channel-group row: the measured plain-DP row of its work (chag_rule.py)
    step_gain: float | None = None  # 1 − its measured step / plain_dp's
    chag_rule: str | None = None  # the design's adopt-or-reject, in words
    run_dir: str | None = None  # the measured run, inside the compare folder
    failure: str | None = None

    def add_prediction(self, report: dict[str, Any]) -> None:
        """Fill the predicted columns from a pre-flight report (Verdict.to_dict, or a run's preflight.json)."""
        plan = Plan(**report["requested_plan"])
        prediction = report["requested_prediction"]
        self.plan, self.world_size, self.global_batch = plan.describe(), plan.world_size, plan.global_batch
        self.requested_plan = dict(report["requested_plan"])
        self.decision, self.predicted_efficiency = report["decision"], report["efficiency"]
        self.min_efficiency, self.best_single = report["min_efficiency"], report["best_single"]
        self.predicted_step_seconds = prediction.get("step_seconds")  # absent where compute was not priced
        self.predicted_samples_per_second = prediction.get("samples_per_second")
        self.predicted_ecd = prediction.get("ecd")
        self.predicted_memory_bytes = prediction["per_device_peak_bytes"]

    def add_measurement(self, report: dict[str, Any], metrics: dict[str, Any], whole: bool = False) -> None:
        """Fill the measured columns from a finished run's preflight.json and metrics.json.

        `whole`: the run trained to the end (accuracy=true), so its test OA counts.
        """
        plan, measured, usage = Plan(**report["requested_plan"]), report.get("measured"), metrics.get("usage", {})
        self.test_oa = metrics.get("OA") if whole else None
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

    def judge_verdict(self) -> None:
        """Set verdict_holds: whether GO agrees with the side of its threshold the measured efficiency fell on.

        None where there is nothing to judge: one device (GO by rule), UNDECIDED, not measured.
        """
        measured, threshold = self.measured_efficiency, self.min_efficiency
        several = self.world_size is not None and self.world_size > 1
        if several and self.decision in ("GO", "NO-GO") and measured is not None and threshold is not None:
            self.verdict_holds = (self.decision == "GO") == (measured >= threshold)


def check_labels(labels: list[str]) -> None:
    """Refuse a label given twice, and a user's label that ends as the reference rows' do."""
    seen: set[str] = set()
    for label in labels:
        if label in seen:
            raise ConfigError(
                f"two rows are labelled {label!r}: give each row a label of its own (rows=FILE.yaml), or list the "
                "recipe once."
            )
        if label.endswith(REFERENCE_SUFFIX):
            raise ConfigError(f"row label {label!r} ends in {REFERENCE_SUFFIX!r}, which compare keeps for the rows it "
                              "adds: rename it.")  # fmt: skip
        seen.add(label)


def parse_options(items: list[str]) -> CompareOptions:
    """Split `hslite compare`'s own keys (OPTION_KEYS) from the overrides every row shares."""
    pairs = parse_overrides(items)
    own = {key: value for key, value in pairs if key in OPTION_KEYS}
    if any(key == "recipe" for key, _ in pairs):
        raise ConfigError("`hslite compare` takes recipes=A,B,... (a list) or rows=FILE.yaml, not recipe=.")
    if not own.get("recipes") and not own.get("rows"):
        raise ConfigError(
            "`hslite compare` needs recipes=A,B,... (names, .yaml paths or patterns such as compare_cpu_*; see "
            "`hslite recipes`) or rows=FILE.yaml (a list of label, recipe and overrides)."
        )
    for flag in ("measure", "reference", "accuracy"):
        if own.get(flag, "true") not in ("true", "false"):
            raise ConfigError(f"{flag} must be true or false, got {own[flag]!r}.")
    if own.get("accuracy") == "true" and own.get("measure") != "true":
        raise ConfigError("accuracy=true trains every row to the end to compare accuracy: it needs measure=true.")
    steps = own.get("steps", str(DEFAULT_STEPS))
    if not steps.isdigit() or int(steps) < 1:
        raise ConfigError(f"steps must be a whole number ≥ 1 (timed optimiser steps per run), got {steps!r}.")
    rows = [RowSpec(None, name) for name in _expand(own["recipes"])] if own.get("recipes") else []
    rows += load_rows(Path(own["rows"])) if own.get("rows") else []
    if own.get("auto"):
        rows.append(RowSpec(None, own["auto"], ["parallel.plan=auto"]))
    return CompareOptions(
        rows=rows,
        overrides=[f"{key}={value}" for key, value in pairs if key not in OPTION_KEYS],
        measure=own.get("measure") == "true",
        steps=int(steps),
        reference=own.get("reference") != "false",
        accuracy=own.get("accuracy") == "true",
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


def load_rows(path: Path) -> list[RowSpec]:
    """The rows of a rows file: a YAML list of {label, recipe, overrides}; each mistake is named with its entry."""
    if not path.is_file():
        raise ConfigError(f"rows file {path} does not exist (from {Path.cwd()}); check the path.")
    try:
        body = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"rows file {path} is not valid YAML ({' '.join(str(err).split())}): fix it there.") from None
    example = "`- {label: dp2, recipe: quickstart_cpu2, overrides: [data.batch_size=32]}`"
    if not isinstance(body, list) or not body:
        raise ConfigError(f"rows file {path} must be a non-empty YAML list of rows such as {example}, got {body!r}.")
    return [_row(path, number, entry, example) for number, entry in enumerate(body, start=1)]


def _row(path: Path, number: int, entry: Any, example: str) -> RowSpec:
    where = f"rows file {path}, entry {number}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is {entry!r}, not a mapping: write it as {example}.")
    unknown = sorted(str(key) for key in entry if key not in ROW_KEYS)
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}: a row takes {', '.join(ROW_KEYS)}.")
    label, recipe, overrides = entry.get("label"), entry.get("recipe"), entry.get("overrides", [])
    if not isinstance(label, str) or not label.strip():
        raise ConfigError(f"{where} has label {label!r}: give it a non-empty text label (the table's first column).")
    if not isinstance(recipe, str) or not recipe.strip():
        raise ConfigError(f"{where} ({label}) has recipe {recipe!r}: name a recipe (`hslite recipes`) or a .yaml path.")
    if not isinstance(overrides, list) or not all(isinstance(item, str) and "=" in item[1:] for item in overrides):
        raise ConfigError(
            f"{where} ({label}) has overrides {overrides!r}: write them as a list of key=value texts, such as "
            "[data.batch_size=32]."
        )
    return RowSpec(label, recipe, overrides)
