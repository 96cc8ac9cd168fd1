"""Training-step timing that every rank logs: what `hslite fit` reports and what the pre-flight is checked against."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import numpy as np


class TrainThroughput(pl.Callback):
    """Time per training batch, logged so it survives spawned ranks (their callbacks die with them).

    A batch's time runs from its start to the next batch's start: forward, backward, optimiser, all-reduce, the
    loop's hooks and fetching the next batch, but not validation or start-up. The median is what the pre-flight
    prediction is compared with.
    """

    def __init__(self) -> None:
        self.batch_seconds: list[float] = []
        self.samples = 0
        self._start: float | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        self._start = None  # the gap across validation is not a batch

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:  # noqa: D102
        now = time.perf_counter()
        if self._start is not None:
            self.batch_seconds.append(now - self._start)
        self._start = now

    def on_train_batch_end(  # noqa: D102
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += len(batch[1]) * trainer.world_size

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        if self._start is not None:  # the epoch's last batch: to its end, there is no next start
            self.batch_seconds.append(time.perf_counter() - self._start)
        # Skip the first batch of the run (lazy initialisation, DDP's first single bucket) in the median.
        steady = self.batch_seconds[1:] or self.batch_seconds
        module.log_dict(
            {
                "perf/median_batch_seconds": float(np.median(steady)),
                "perf/train_batch_seconds": float(sum(self.batch_seconds)),
                "perf/train_samples": float(self.samples),
                "perf/epochs": float(trainer.current_epoch + 1),
                "perf/optimizer_steps": float(trainer.global_step),
            },
            sync_dist=True,
            reduce_fx="max",  # the slowest rank sets the pace of a synchronous step
        )
