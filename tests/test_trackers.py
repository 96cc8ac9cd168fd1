"""Runs reach the trackers teams use: `output.loggers` adds TensorBoard, MLflow or W&B beside logs/metrics.csv.

One short fit logs to TensorBoard and MLflow and leaves both in its run folder, test scores included; a tracker whose
package is missing is one sentence before any folder exists; `trainer.test` in a Lightning script scores the task.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import pytest
import torch
from quick_fit import NO_PREFLIGHT, QUICK_FIT

from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.settings import DataSettings
from hslite.errors import ConfigError
from hslite.models import get_model
from hslite.recipe.config import load_config
from hslite.recipe.schema import LOGGERS, described_keys
from hslite.run.fit import fit
from hslite.run.loggers import TRACKERS
from hslite.run.resume import resumed_config
from hslite.run.training_state import TrainingState
from hslite.task import HSIClassifier

MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A two-epoch run with output.loggers=[tensorboard,mlflow], and the MLflow variables as the run left them."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        for name in MLFLOW_VARIABLES:
            patch.delenv(name, raising=False)  # the run's own file store, whatever this machine points MLflow at
        cfg = load_config("quickstart", [*QUICK_FIT, NO_PREFLIGHT, "train.max_epochs=2", f"output.root={root}",
                                         "output.loggers=[tensorboard,mlflow]"])  # fmt: skip
        run = fit(cfg)
        left = {name: os.environ.get(name) for name in MLFLOW_VARIABLES}
    return run, left


def test_tensorboard_events_hold_the_curves_and_the_test_scores(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tracked
    assert (run.run_dir / "logs" / "metrics.csv").is_file()  # the CSV is kept
    events = EventAccumulator(str(run.run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "val/OA", "test/OA", "test/AA", "test/kappa"} <= set(scalars)
    for name in ("OA", "AA", "kappa"):
        (logged,) = events.Scalars(f"test/{name}")
        assert logged.value == pytest.approx(run.metrics[name]) and logged.step == run.metrics["optimizer_steps"]
    accuracies = zip(run.metrics["class_names"], run.metrics["per_class_accuracy"], strict=True)
    assert {f"test/per_class_accuracy/{c}" for c, acc in accuracies if acc is not None} <= set(scalars)


def test_mlflow_file_store_holds_a_finished_run_of_the_recipe_with_the_test_scores(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    run, _ = tracked
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when told to
    client = MlflowClient(tracking_uri=(run.run_dir / "mlruns").as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == run.run_dir.name  # the folder's stamp
    for name in ("OA", "AA", "kappa"):
        assert found.data.metrics[f"test/{name}"] == pytest.approx(run.metrics[name])
    assert "train/loss" in found.data.metrics and {"lr", "weight_decay"} <= set(found.data.params)  # the task's


def test_a_resumed_run_goes_on_in_its_tensorboard_folder_and_may_add_a_tracker(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in MLFLOW_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    quick = [*QUICK_FIT, NO_PREFLIGHT, "train.max_epochs=3", f"output.root={tmp_path}"]
    with monkeypatch.context() as crashing:

        def crash(self, trainer, pl_module):
            if trainer.current_epoch == 2:
                raise RuntimeError("simulated crash")

        crashing.setattr(TrainingState, "on_train_epoch_start", crash, raising=False)
        with pytest.raises(RuntimeError, match="simulated crash"):
            fit(load_config("quickstart", [*quick, "output.loggers=[tensorboard]"]))
    (failed,) = (tmp_path / "quickstart").iterdir()
    run = fit(resumed_config([f"resume={failed}", *quick, "output.loggers=[tensorboard,mlflow]"]))
    assert run.run_dir.name == failed.name.removesuffix(".failed")
    events = EventAccumulator(str(run.run_dir / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("val/OA")) == 3 and len(events.Scalars("test/OA")) == 1  # both parts, one curve
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run.run_dir / "mlruns").as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert found.info.run_name == f"{run.run_dir.name}-resumed-1" and "test/OA" in found.data.metrics


def test_the_run_leaves_mlflow_where_it_found_it(tracked):
    import mlflow

    run, left = tracked
    assert left == {"MLFLOW_TRACKING_URI": None, "MLFLOW_ALLOW_FILE_STORE": None}
    # the next run, or the caller's own use of mlflow, is not pointed at this run's store
    assert str(run.run_dir.parents[1]) not in mlflow.get_tracking_uri()  # output.root


@pytest.mark.parametrize(("tracker", "modules"), [("tensorboard", ["tensorboard", "tensorboardX"]),
                                                  ("mlflow", ["mlflow"]), ("wandb", ["wandb"])])  # fmt: skip
def test_a_missing_tracker_package_is_one_sentence_before_the_run_folder(tracker, modules, tmp_path, monkeypatch):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # what `import` says when the package is not installed
    cfg = load_config("quickstart", [*QUICK_FIT, NO_PREFLIGHT, f"output.root={tmp_path}",
                                     "output.loggers=[tensorboard,mlflow,wandb]"])  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        fit(cfg)
    message = str(refused.value)
    assert message.startswith(f"output.loggers names {tracker}, and its package ")
    assert f'pip install "hslite[{tracker}]"' in message and message.count(". ") == 0 and message.endswith(".")
    assert not any(tmp_path.iterdir())  # refused before the run folder was made


def test_an_unknown_logger_is_refused_naming_it_and_the_allowed_ones():
    with pytest.raises(ConfigError, match="output.loggers names 'neptune', which hslite has no logger for: name "
                                          "only 'csv', 'tensorboard', 'mlflow' or 'wandb'."):  # fmt: skip
        load_config("quickstart", ["output.loggers=[tensorboard,neptune]"])
    assert load_config("quickstart", ["output.loggers=[csv]"]).output.loggers == ["csv"]  # kept anyway: no harm
    assert set(LOGGERS) == {"csv", *TRACKERS}  # each name the schema allows is a tracker hslite can build, or csv
    (why,) = [why for key, _, why in described_keys() if key == "output.loggers"]
    assert 'pip install "hslite[NAME]"' in why and "logs/metrics.csv is always written" in why  # recipes --keys


def test_trainer_test_in_a_lightning_script_logs_the_test_scores():
    torch.manual_seed(0)
    datamodule = HSIDataModule(
        DataSettings("synthetic_tiny", patch_size=3, batch_size=16, eval_batch_size=64, train_fraction=0.3)
    )
    datamodule.setup("fit")
    model = get_model("cnn1d", in_bands=datamodule.num_bands, num_classes=datamodule.num_classes, patch_size=3)
    task = HSIClassifier(model, num_classes=datamodule.num_classes, warmup_epochs=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(task, datamodule=datamodule)
    (tested,) = trainer.test(task, datamodule=datamodule, verbose=False)
    assert set(tested) == {"test/loss", "test/OA", "test/AA", "test/kappa"}

    # the same scores as `hslite fit` reports for these weights (AA too: every class has test pixels here)
    predicted = torch.cat(trainer.predict(task, dataloaders=datamodule.test_dataloader()))
    targets = torch.cat([y for _, y in datamodule.test_dataloader()])
    scores = task.score(predicted, targets)
    assert all(n > 0 for n in scores["confusion_matrix"].sum(1))
    for name in ("OA", "AA", "kappa"):
        assert tested[f"test/{name}"] == pytest.approx(scores[name], abs=1e-6)
    assert 0.25 < tested["test/OA"] <= 1  # trained: better than chance on 4 classes
