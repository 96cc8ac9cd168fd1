"""What a training step costs around the model: the loss logged only when Lightning writes it, the bar redrawn at most
ten times a second (benchmarks/framework_tax.py measures the step against a bare Lightning loop)."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from hslite.parallel import progress_bar
from hslite.task import HSIClassifier


class StepLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: D102
        self.losses.append(float(outputs["loss"]))


def test_train_loss_is_the_mean_since_the_last_logging_step_logged_only_then_and_at_the_epochs_end(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    task = HSIClassifier(torch.nn.Linear(6, 3), num_classes=3, warmup_epochs=0)
    logged = []

    def log(name, value, *args, **kwargs):
        if name == "train/loss":
            logged.append(float(value))
        return original(name, value, *args, **kwargs)

    original, task.log = task.log, log
    losses = StepLosses()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, log_every_n_steps=4, limit_val_batches=0,
                         logger=CSVLogger(tmp_path, name="logs", version=""), callbacks=[losses],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(task, train_dataloaders=DataLoader(data, batch_size=4))  # 10 steps: logs at 4 and 8, and at 10
    step = losses.losses
    expected = [sum(step[0:4]) / 4, sum(step[4:8]) / 4, sum(step[8:10]) / 2]
    assert logged == pytest.approx(expected, rel=1e-6)  # three calls of self.log, not ten
    with open(tmp_path / "logs" / "metrics.csv") as f:
        written = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert written[:2] == pytest.approx(expected[:2], rel=1e-6)
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(expected[2], rel=1e-6)


def test_the_bar_is_redrawn_at_most_every_tenth_of_a_second_and_at_each_epochs_last_batch(monkeypatch):
    drawn = []
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, t, m, o, b, i: drawn.append(i))
    clock = iter([0.0, 0.01, 0.05, 0.11, 0.12, 0.13])
    monkeypatch.setattr(progress_bar.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(progress_bar.RedrawnProgressBar, "total_train_batches", property(lambda self: 6))
    bar = progress_bar.RedrawnProgressBar()
    for batch_idx in range(6):
        bar.on_train_batch_end(None, None, None, None, batch_idx)
    assert drawn == [0, 3, 5]  # the first, the first 0.1 s later, the epoch's last


def test_the_epochs_training_scores_count_every_step_once(tmp_path):
    from torchmetrics.classification import MulticlassAccuracy, MulticlassCohenKappa

    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    y[::7] = -1  # unlabelled samples count nowhere
    task = HSIClassifier(torch.nn.Linear(6, 3), num_classes=3, lr=0.0, weight_decay=0.0, warmup_epochs=0)  # fixed
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(task, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=4))
    with torch.no_grad():
        logits = task.model(x)
    expected = {"OA": MulticlassAccuracy(3, average="micro", ignore_index=-1)(logits, y),
                "AA": MulticlassAccuracy(3, average="macro", ignore_index=-1)(logits, y),
                "kappa": MulticlassCohenKappa(3, ignore_index=-1)(logits, y)}  # fmt: skip
    for name, value in expected.items():
        assert float(trainer.callback_metrics[f"train/{name}"]) == pytest.approx(float(value), abs=1e-6), name
