"""The trackers a run logs to as well as its CSV (`output.loggers`): TensorBoard, MLflow and Weights & Biases.

Lightning's own loggers, writing inside the run folder: TensorBoard event files in tensorboard/, an MLflow file store
in mlruns/ (or the tracking server MLFLOW_TRACKING_URI names), W&B's files in wandb/ (offline with WANDB_MODE=offline).
logs/metrics.csv is written whatever the list says (`fit._trainer`). A tracker whose package is missing is refused
before the run folder exists (`check_installed`); the test scores reach every tracker after the evaluation
(`log_test_scores`), as metrics.json has them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hslite.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger


@dataclass(frozen=True)
class Tracker:
    """What a tracker's Lightning logger needs installed, and how to install it."""

    modules: tuple[str, ...]  # Lightning's logger works with any one of them
    package: str  # what `pip install` takes, besides hslite's extra of the tracker's name


# output.loggers' names but csv (recipe.schema.LOGGERS)
TRACKERS = {
    "tensorboard": Tracker(("tensorboard", "tensorboardX"), "tensorboard"),
    "mlflow": Tracker(("mlflow",), "mlflow-skinny"),  # the client alone; full mlflow (the UI, a server) works too
    "wandb": Tracker(("wandb",), "wandb"),
}


def check_installed(names: Sequence[str]) -> None:
    """Refuse, in one sentence saying what to install, a tracker whose package this Python cannot import."""
    for name in names:
        tracker = TRACKERS.get(name)
        if tracker is not None and not any(importlib.util.find_spec(module) for module in tracker.modules):
            raise ConfigError(
                f"output.loggers names {name}, and its package {tracker.package} is not installed in this Python: "
                f'run pip install "hslite[{name}]" (or pip install {tracker.package}), or drop {name} from '
                "output.loggers."
            )


@contextmanager
def tracker_environment(names: Sequence[str]) -> Iterator[None]:
    """The environment variables MLflow needs while the run lasts, restored when it ends.

    MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set (it would have a database, which
    mlflow-skinny cannot write). Lightning's logger points MLFLOW_TRACKING_URI at the run's store
    (`mlflow.set_tracking_uri`): left there, the next fit in this process would log into this run's store.
    Spawned ranks start inside this block and inherit what it sets.
    """
    if "mlflow" not in names:
        yield
        return
    saved = {key: os.environ.get(key) for key in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")}
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's own "false" stands
    try:
        yield
    finally:
        mlflow = sys.modules.get("mlflow")
        if mlflow is not None:
            mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])  # None: MLflow's own default again
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def tracker_loggers(names: Sequence[str], run_dir: Path, experiment: str, resumptions: int) -> list[Logger]:
    """Lightning's logger of each tracker `names` asks for, writing into `run_dir`; the CSV logger is the caller's.

    `experiment` groups runs (the recipe); a run is named by its folder's stamp, and a resumed part by its number too
    (`resumptions`: the parts before it). The MLflow and W&B runs start here, in the process that logs the test scores
    after training: spawned ranks get them pickled and log into them, where otherwise rank 0 would start one and this
    process another for the scores.
    """
    stamp = run_dir.name.partition(".")[0]  # the folder is <stamp>.incomplete while the run lasts
    run_name = f"{stamp}-resumed-{resumptions}" if resumptions else stamp
    loggers: list[Logger] = []
    if "tensorboard" in names:
        from lightning.pytorch.loggers import TensorBoardLogger

        # One folder for every part of a resumed run: TensorBoard reads each part's event file, and drops the steps
        # a stopped part logged after its last checkpoint once the next part logs them again.
        loggers.append(TensorBoardLogger(run_dir, name="tensorboard", version="", default_hp_metric=False))
    if "mlflow" in names:
        from lightning.pytorch.loggers import MLFlowLogger

        # Passed, not left to the logger: its default reads MLFLOW_TRACKING_URI when Lightning is imported.
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        mlflow = MLFlowLogger(experiment_name=experiment, run_name=run_name, tracking_uri=uri)
        mlflow.experiment  # noqa: B018 - starts the run (see above)
        loggers.append(mlflow)
    if "wandb" in names:
        from lightning.pytorch.loggers import WandbLogger

        offline = os.environ.get("WANDB_MODE") == "offline"
        wandb = WandbLogger(name=run_name, project=experiment, save_dir=str(run_dir), offline=offline)
        wandb.experiment  # noqa: B018 - starts the run (see above)
        loggers.append(wandb)
    return loggers


def log_test_scores(trainer: pl.Trainer, scores: dict[str, Any], class_names: Sequence[str], step: int) -> None:
    """The run's test scores in each tracker of `trainer`: test/OA, AA, kappa and per_class_accuracy/<class name>.

    Names and values are metrics.json's (`HSIClassifier.score`: AA over the classes with test pixels). `step`: the
    training's last optimiser step. The CSV logger is left out: in a run whose ranks were spawned, this process never
    wrote logs/metrics.csv, and Lightning's CSV writer deletes a metrics.csv it did not write; metrics.json beside it
    has the scores.
    """
    from lightning.pytorch.loggers import CSVLogger

    values = {f"test/{name}": float(scores[name]) for name in ("OA", "AA", "kappa")}
    for name, accuracy in zip(class_names, scores["per_class_accuracy"], strict=True):
        if accuracy is not None:  # a class with no test pixel has no accuracy
            values[f"test/per_class_accuracy/{_metric_name(name)}"] = float(accuracy)
    for logger in trainer.loggers:
        if not isinstance(logger, CSVLogger):
            logger.log_metrics(values, step=step)
            logger.finalize("success")  # Lightning finalized it after training; this writes the scores out


def _metric_name(class_name: str) -> str:
    """A class name as MLflow accepts it in a metric name (letters, digits, _ - . and spaces); / would nest it."""
    return re.sub(r"[^\w\-. ]", "_", class_name)
