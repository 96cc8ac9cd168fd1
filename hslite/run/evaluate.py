"""The best weights' predictions after training: the scored test pixels, and the whole scene when a map is asked.

Inference runs on one device, whatever the plan trained on; `predictions` chooses between one pass and two.
"""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader

from hslite.datasets.datamodule import HSIDataModule
from hslite.parallel.plan import Plan
from hslite.parallel.trainer_args import trainer_kwargs
from hslite.recipe.schema import Config
from hslite.task import HSIClassifier


def predictions(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, task: HSIClassifier
) -> tuple[np.ndarray, np.ndarray | None]:
    """Predicted classes of the scored test pixels, and of the whole scene when a map is asked (None otherwise).

    train.limit_test_batches limits the test pass only, and a map is always of the whole scene: with a map asked and
    no limit, one pass over the scene serves both; otherwise the test pass and the map are two.
    """
    if cfg.output.save_map and cfg.train.limit_test_batches == 1.0:
        return _scored_from_the_map(plan, datamodule, task)
    return _tested_then_mapped(cfg, plan, datamodule, task)


def _scored_from_the_map(plan: Plan, datamodule: HSIDataModule, task: HSIClassifier) -> tuple[np.ndarray, np.ndarray]:
    """One pass: the whole scene is predicted, and its test pixels are scored from that map."""
    predicted = _predict(_evaluator(plan), task, datamodule.predict_dataloader())
    test = datamodule.split.test
    return predicted.reshape(datamodule.scene.gt.shape)[test[:, 0], test[:, 1]], predicted


def _tested_then_mapped(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, task: HSIClassifier
) -> tuple[np.ndarray, np.ndarray | None]:
    """Two passes: the test pixels (as many batches as train.limit_test_batches), then the scene when a map is asked."""
    tester = _evaluator(plan, limit_predict_batches=batch_limit(cfg.train.limit_test_batches))
    scored = _predict(tester, task, datamodule.test_dataloader())
    return scored, _predict(_evaluator(plan), task, datamodule.predict_dataloader()) if cfg.output.save_map else None


def _evaluator(plan: Plan, **limits: Any) -> pl.Trainer:
    """A one-device Trainer for inference, whatever the plan trained on."""
    return pl.Trainer(**trainer_kwargs(plan.single_device(), progress=False), logger=False, **limits)


def _predict(trainer: pl.Trainer, task: HSIClassifier, loader: DataLoader) -> np.ndarray:
    """Zero-based predicted class of every sample of `loader`, in its order."""
    batches = cast(list[torch.Tensor], trainer.predict(task, dataloaders=loader))
    return torch.cat(batches).numpy().astype(np.int64, copy=False)  # a scene's worth: no third copy


def batch_limit(value: float) -> float | int | None:
    """Lightning's limit_*_batches: None for 'all' (its default, so it does not announce it), a count above 1."""
    if value == 1.0:
        return None
    return int(value) if value > 1 else float(value)


def log_interval(loader_batches: int, plan: Plan, limit: float) -> int:
    """Lightning's log_every_n_steps: 50, or an epoch's steps on each rank when fewer (`limit`: limit_train_batches).

    Lightning warns when the interval is longer than an epoch, and each of the plan's dp ranks steps through
    1/dp of the loader.
    """
    steps = max(1, loader_batches // plan.dp)
    return min(50, steps, int(limit)) if limit > 1 else min(50, steps)
