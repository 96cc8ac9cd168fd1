"""The Python API: the CLI's commands as calls that return objects instead of exit codes.

    import hslite
    run = hslite.fit("salinas_a_1gpu", {"data.root": "../shared/data", "train.max_epochs": 30})
    run.metrics["OA"], run.run_dir, run.best_checkpoint
    verdict = hslite.preflight("quickstart_cpu4")          # verdict.go, .exit_code, .reasons, .better_plan
    verdict = hslite.preflight(module=MyModule(), datamodule=MyData(), plan={"devices": 2})
    table = hslite.compare(["quickstart_cpu2", "quickstart_cpu4"], measure=True, steps=10)
    hslite.predict(run.run_dir, cube="flightline.hdr")

Each call takes what the command line takes, a recipe and `key=value` overrides (a list of "key=value" strings or a dict
of Python values, which arrive as given), plus what a command line cannot carry: `fit(model=MyNet)` trains a model class
that follows the model protocol (`hslite.models.ModelClass`), registered under `model.name` so that the run's folder
names it and `predict` can rebuild it in this process. Bad input raises `hslite.HSLiteError` (a subclass per kind) with
the sentence the CLI would print. A call leaves the caller's process as it found it (threads, deterministic kernels,
TF32, random generators, warning filters, log levels, environment: `hslite.process.caller_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hslite.errors import ConfigError
from hslite.preflight_check.price.regime import DEFAULT_MIN_EFFICIENCY
from hslite.process.caller_state import caller_state_kept
from hslite.recipe.config import text_value, value_text

if TYPE_CHECKING:
    from hslite.comparison.rows import CompareOptions, CompareRow
    from hslite.models import ModelClass
    from hslite.preflight_check.decide.verdict import Verdict
    from hslite.run.fit import RunResult
    from hslite.run.predict import PredictResult

Overrides = Mapping[str, Any] | Sequence[str]


def override_items(overrides: Overrides | None) -> list[str]:
    """`key=value` strings from a dict of Python values, each read back as exactly that value, or a list of them."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides must be a list of 'key=value' strings or a dict, got the string {overrides!r}: "
            f"write [{overrides!r}]."
        )
    if isinstance(overrides, Mapping):
        return [f"{key}={value_text(value)}" for key, value in overrides.items()]
    return [str(item) for item in overrides]


def fit(recipe: str | None = None, overrides: Overrides | None = None, *, model: ModelClass | None = None) -> RunResult:
    """Train, test and report a recipe, as `hslite fit`: returns the run (`run_dir`, `metrics`, `best_checkpoint`).

    `model`: a model class of your own (the model protocol, `hslite.models.ModelClass`); it is registered under
    the `model.name` override, or under its class name in lower case, and trained as that name. `resume=last` or
    `resume=RUN_DIR` in the overrides continues a run, as on the command line.
    """
    items = override_items(overrides)
    if model is not None:
        from hslite.models import register

        named = [text_value(item.partition("=")[2]) for item in items if item.startswith("model.name=")]
        name = str(named[-1]) if named else str(getattr(model, "__name__", "")).lower()
        register(name, model, replace=True)
        items = [*items, f"model.name={value_text(name)}"]
    from hslite.recipe.config import load_config
    from hslite.run.resume import resumed_config

    if recipe is not None:
        items = [f"recipe={value_text(recipe)}", *items]
    cfg = resumed_config(items) if any(item.startswith("resume=") for item in items) else load_config(None, items)
    from hslite.run.fit import fit as fit_config  # torch + Lightning: only once the config is known to be valid

    with caller_state_kept():
        return fit_config(cfg)


def preflight(
    recipe: str | None = None,
    overrides: Overrides | None = None,
    *,
    module: Any = None,
    datamodule: Any = None,
    sample_batch: Any = None,
    plan: Any = None,
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    device: str | None = None,
    topology: str | None = None,
) -> Verdict:
    """The pre-flight verdict on a recipe's plan, as `hslite preflight`, or on a LightningModule of your own.

    `verdict.go` (None when it cannot be decided here), `.exit_code` (0, 3, 4), `.reasons`, `.better_plan`,
    `.to_dict()` (what `--json` prints), `.render_table()` (a rich Table).

    `module=`: a LightningModule of your own, priced on its own `training_step` and `configure_optimizers`, with
    batches from `datamodule` (its training loader's first) or `sample_batch`; `plan` is the layout to check, a
    `hslite.parallel.plan.Plan` or a dict of its fields ({"devices": 4, "accelerator": "gpu", "precision":
    "bf16-mixed"}), at the batch's own rows per device. Links are measured on this box (spawned ranks: call it under
    `if __name__ == "__main__":`). Inside a Trainer, `hslite.PreflightGate` does the same on the launched job.
    `device=` and `topology=` (bundled profile names, as preflight.device and preflight.topology): price the
    module on GPUs that are not here, counted on fake tensors and priced from the GPU's datasheet and the box's links.
    """
    if module is not None:
        from hslite.preflight_check.own_script.check import (
            first_batch,
            plan_from,
            preflight_module,
            preflight_module_on_profile,
        )

        if recipe is not None or overrides:
            raise ConfigError("preflight takes a recipe or a module, not both: the module's own plan is `plan=`.")
        if (datamodule is None) == (sample_batch is None):
            raise ConfigError("preflight(module=...) needs exactly one of datamodule= and sample_batch= to probe with.")
        if (device is None) != (topology is None):
            raise ConfigError(
                f"preflight(module=...) prices GPUs that are not here with both device= (which GPU) and topology= "
                f"(the box they are in), got device={device!r} and topology={topology!r}; give both, or neither to "
                "measure this box."
            )
        with caller_state_kept():
            batch = sample_batch if sample_batch is not None else first_batch(datamodule)
            if device is not None and topology is not None:
                return preflight_module_on_profile(module, batch, plan_from(plan), device, topology,
                                                   min_efficiency=min_efficiency)  # fmt: skip
            return preflight_module(module, batch, plan_from(plan), min_efficiency=min_efficiency)
    if device is not None or topology is not None:
        raise ConfigError(
            "device= and topology= price a module of your own; a recipe names them as overrides: "
            '["preflight.device=NAME", "preflight.topology=NAME"].'
        )
    from hslite.recipe.config import load_config

    cfg = load_config(recipe, override_items(overrides))
    from hslite.recipe.gate import check_recipe

    with caller_state_kept():
        return check_recipe(cfg)


@dataclass
class CompareTable:
    """What `hslite compare` measured or predicted: one row per plan, and the folder of its reports."""

    rows: list[CompareRow]
    folder: Path  # compare.csv, compare.json, compare.png
    options: CompareOptions

    def to_dict(self) -> dict[str, Any]:
        """compare.json's content."""
        from hslite.comparison.report import compare_json

        return compare_json(self.rows, self.options)


def compare(
    recipes: Sequence[str] | str,
    overrides: Overrides | None = None,
    *,
    measure: bool = False,
    steps: int | None = None,
    reference: bool = True,
) -> CompareTable:
    """Several recipes side by side, as `hslite compare recipes=...`: predicted, and with `measure=True` measured.

    `recipes`: names, globs (`"compare_cpu_*"`) or .yaml paths; `overrides` apply to every row.
    """
    from hslite.comparison.measure import run_compare
    from hslite.comparison.rows import parse_options

    names = [recipes] if isinstance(recipes, str) else list(recipes)
    options_items = [f"recipes={','.join(names)}", f"measure={value_text(measure)}"]
    options_items += [f"reference={value_text(reference)}"] + ([f"steps={steps}"] if steps is not None else [])
    options = parse_options([*options_items, *override_items(overrides)])
    with caller_state_kept():
        rows, folder = run_compare(options)
    return CompareTable(rows=rows, folder=folder, options=options)


def predict(run: str | Path, cube: str | Path | None = None, overrides: Overrides | None = None) -> PredictResult:
    """Map a cube (default: the run's own scene) with a finished run, as `hslite predict`.

    Returns the output folder (`out_dir`: prediction.tif, map.png, ...) and the class (1..C) of every pixel.
    """
    from hslite.run.predict import parse_options
    from hslite.run.predict import predict as predict_options

    items = [f"run={value_text(run)}", *([f"cube={value_text(cube)}"] if cube is not None else [])]
    items += override_items(overrides)
    with caller_state_kept():
        return predict_options(parse_options(items))
