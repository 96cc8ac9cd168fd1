"""Training-step timing that every rank logs: what `hslite fit` reports and what the pre-flight is checked against."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from hslite.parallel.host_reduce import max_over_ranks


class TrainThroughput(pl.Callback):
    """Time per training batch, logged so it survives spawned ranks (their callbacks die with them).

    A batch's time runs from its start to the next batch's start: forward, backward, optimiser, all-reduce, the
    loop's hooks and fetching the next batch, but not validation or start-up. The median is what the pre-flight
    prediction is compared with. Each validation also logs `perf/elapsed_seconds`, the wall time since training
    began: with val/OA beside it in metrics.csv it says when a run first reached an accuracy (time to accuracy).
    """

    def __init__(self) -> None:
        self.batch_seconds: list[float] = []
        self.samples = 0
        self._start: float | None = None
        self._fit_start = 0.0

    def state_dict(self) -> dict[str, Any]:
        """The batches timed so far: a resumed run reports the whole run's samples and steps, not its last part."""
        return {"batch_seconds": list(self.batch_seconds), "samples": self.samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102
        self.batch_seconds = list(state_dict["batch_seconds"])
        self.samples = int(state_dict["samples"])

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        self._fit_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        if not trainer.sanity_checking:
            module.log("perf/elapsed_seconds", time.perf_counter() - self._fit_start)

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
        device = trainer.strategy.root_device
        if device.type == "cuda":  # steps do not wait for the GPU (task.py): the epoch's last work may still be queued
            torch.cuda.synchronize(device)
        if self._start is not None:  # the epoch's last batch: to its end, there is no next start
            self.batch_seconds.append(time.perf_counter() - self._start)
        # Skip the first batch of the run (lazy initialisation, DDP's first single bucket) in the median.
        steady = self.batch_seconds[1:] or self.batch_seconds
        names = ("median_batch_seconds", "train_batch_seconds", "train_samples", "epochs", "optimizer_steps")
        values = torch.tensor(
            [np.median(steady), sum(self.batch_seconds), self.samples, trainer.current_epoch + 1, trainer.global_step],
            dtype=torch.float64,
        )
        # The slowest rank sets the pace of a synchronous step. Host figures, reduced on the host (over gloo on GPUs
        # too: trainer_args.process_group_backend), on every rank in the same order: logged with sync_dist, the max
        # would be taken lazily, by whoever reads the metrics first, and the progress bar reads them on rank 0 alone,
        # which then waits in an all-reduce the other ranks never join.
        values = max_over_ranks(values)
        module.log_dict({f"perf/{name}": float(value) for name, value in zip(names, values, strict=True)})
