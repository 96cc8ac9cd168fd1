"""Continue a stopped run from its last checkpoint, in its own folder: `hslite fit resume=last|RUN_DIR [k=v ...]`.

The run continues with the config it was started with (its config.yaml); overrides on the command line may only
change what does not change the numbers (the progress bar, the pre-flight), and any other that differs is refused
with the fields that differ, as is a checkpoint whose stored config does not match the run's. Model, optimiser,
scheduler, loop position and callback state come back through Lightning's `ckpt_path`; each rank's random state, its
augmentation generator and its compression residuals through `TrainingState` and the strategy, so a resumed run ends
with the metrics of an uninterrupted one (CPU, same seed).
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hslite.errors import ConfigError, DataError
from hslite.recipe.config import load_config, parse_overrides, text_value
from hslite.recipe.schema import Config, DeadlinesConfig

# Keys that may differ between the run and its resumption: none changes what is trained or how.
# A run that a deadline ended is continued with a longer one: deadlines change when, not what, it trains.
# Trackers (output.loggers) only watch; and a checkpoint written before the key existed stores no value for it.
HARMLESS_KEYS = ("resume", "train.progress", "preflight.enabled", "preflight.enforce", "preflight.fresh",
                 "output.loggers", *(f"parallel.deadlines.{f.name}" for f in fields(DeadlinesConfig)))  # fmt: skip
_STAMP = re.compile(r"^\d{8}-\d{6}-\d{6}(-\d+)?(\.incomplete|\.failed)?$")
LAST = "last.ckpt"


def flat_config(cfg: Config) -> dict[str, Any]:
    """The config as {"section.key": value}, what a checkpoint stores to be recognised by."""
    nested = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}", value)
        else:
            flat[prefix] = node

    walk("", nested)
    return flat


def config_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """'key: theirs -> ours' for every key that differs, the harmless ones left out."""
    keys = sorted((set(ours) | set(theirs)) - set(HARMLESS_KEYS))
    return [f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]


def resumed_config(items: list[str]) -> Config:
    """The config of the run that `resume=` names, with the harmless overrides applied; anything else refused."""
    pairs = parse_overrides(items)
    where = str(next(text_value(v) for k, v in pairs if k == "resume"))
    rest = [f"{k}={v}" for k, v in pairs if k != "resume"]
    run = _find_run(where, rest)
    checkpoint = run / "checkpoints" / LAST
    if not checkpoint.is_file():
        raise DataError(
            f"{run} has no checkpoints/{LAST}: it stopped before its first epoch ended (or ran with "
            "output.save_checkpoint=false). Start it again without resume=."
        )
    saved_path = run / "config.yaml"
    saved = load_config(str(saved_path))
    recipe = next((str(text_value(v)) for k, v in reversed(pairs) if k == "recipe"), None)  # the last, as load_config
    if recipe is not None and recipe not in (saved.recipe, str(saved_path)):
        raise ConfigError(f"resume={where}: {run} is a run of recipe {saved.recipe!r}, not {recipe!r}.")
    cfg = load_config(str(saved_path), [item for item in rest if not item.startswith("recipe=")])
    changed = config_differences(flat_config(cfg), flat_config(saved))
    if changed:
        raise ConfigError(
            f"resume={where}: these overrides change the run being resumed ({'; '.join(changed)}). A resumed run "
            "trains with the config it started with; drop them, or start a new run."
        )
    cfg.resume = str(run.resolve())
    return cfg


def check_checkpoint_config(checkpoint: dict[str, Any], cfg: Config, path: Path) -> None:
    """Refuse a checkpoint written for another config (model, data, training), naming the fields that differ."""
    stored = checkpoint.get("hslite", {}).get("config")
    if stored is None:
        raise DataError(f"{path} was not written by hslite fit (it carries no hslite config); it cannot resume a run.")
    # a setting added to hslite after the checkpoint was written is absent from it: that run had its default, which a
    # new setting keeps as the old behaviour
    changed = config_differences(flat_config(cfg), {**flat_config(Config()), **stored})
    if changed:
        raise DataError(f"{path} was written for another config: {'; '.join(changed)}. Resume it with its own run.")


def _find_run(where: str, overrides: list[str]) -> Path:
    if where != "last":
        path = Path(where).expanduser()
        if path.is_file() and path.parent.name == "checkpoints":
            path = path.parent.parent  # a checkpoint inside a run folder names that run
        if not (path / "config.yaml").is_file():
            raise DataError(
                f"resume={where}: {path} is not a run folder of hslite fit (no config.yaml); pass resume=last or "
                "a folder runs/<recipe>/<stamp>[.failed|.incomplete]."
            )
        return path
    cfg = load_config(None, overrides)  # output.root and recipe say where this recipe's runs are
    parent = Path(cfg.output.root) / cfg.recipe
    candidates = sorted(
        p for p in (parent.iterdir() if parent.is_dir() else ()) if _STAMP.match(p.name) and p.suffix != ""
    )
    if not candidates:
        raise DataError(
            f"resume=last: no stopped run of recipe {cfg.recipe!r} under {parent} (a .failed or .incomplete folder); "
            "finished runs are not resumed. Pass the run folder itself with resume=PATH, or start a new run."
        )
    return candidates[-1]
