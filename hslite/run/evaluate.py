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
from hslite.parallel.trainer.trainer_args import trainer_kwargs
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
    predicted = _predict(plan, task, datamodule.predict_dataloader(), datamodule.scene.gt.size)
    test = datamodule.split.test
    return predicted.reshape(datamodule.scene.gt.shape)[test[:, 0], test[:, 1]], predicted


def _tested_then_mapped(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, task: HSIClassifier
) -> tuple[np.ndarray, np.ndarray | None]:
    """Two passes: the test pixels (as many batches as train.limit_test_batches), then the scene when a map is asked."""
    limit = batch_limit(cfg.train.limit_test_batches)
    scored = _predict(plan, task, datamodule.test_dataloader(), len(datamodule.split.test), limit_predict_batches=limit)
    if not cfg.output.save_map:
        return scored, None
    return scored, _predict(plan, task, datamodule.predict_dataloader(), datamodule.scene.gt.size)


def _predict(plan: Plan, task: HSIClassifier, loader: DataLoader, samples: int, **limits: Any) -> np.ndarray:
    """Zero-based predicted class of each sample of `loader` (at most `samples`), in its order, on one device."""
    collected = _Collected(samples)
    kwargs = trainer_kwargs(plan.single_device(), progress=False)
    trainer = pl.Trainer(**{**kwargs, "callbacks": [*kwargs["callbacks"], collected]}, logger=False, **limits)
    trainer.predict(task, dataloaders=loader, return_predictions=False)
    return collected.classes[: collected.filled]


class _Collected(pl.Callback):
    """Each batch's predicted classes, copied into one array allocated before the pass.

    Lightning's own collection keeps every batch's tensor until the pass ends: small allocations that live between
    the large, short-lived ones of each step, so a heap that keeps freed memory (`keep_freed_memory`) cannot reuse
    those and grows through a map pass (`benchmarks/scene_scaling.py --repeat 3` shows the fit's worst peak).
    """

    def __init__(self, samples: int):
        self.classes = np.empty(samples, dtype=np.int64)
        self.filled = 0

    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        predicted = cast(torch.Tensor, outputs)
        self.classes[self.filled : self.filled + len(predicted)] = predicted.cpu().numpy()
        self.filled += len(predicted)


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
