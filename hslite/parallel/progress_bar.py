"""Lightning's rich progress bar, redrawn during training at most every REDRAW_SECONDS instead of after every batch.

A redraw reads every progress-bar value to the host (`get_metrics`, a device sync on a GPU) and renders the bar,
which weighs on a model whose step takes a millisecond or two (benchmarks/framework_tax.py sets hslite's step beside
a bare Lightning loop's). Ten redraws a second look the same to a reader; the last batch of an epoch is always drawn.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar

REDRAW_SECONDS = 0.1


class RedrawnProgressBar(RichProgressBar):
    """RichProgressBar whose training bar is redrawn at most every REDRAW_SECONDS, and at each epoch's last batch."""

    def __init__(self, leave: bool = False) -> None:
        super().__init__(leave=leave)
        self._drawn_at = -math.inf  # the first batch is drawn

    def on_train_batch_end(  # noqa: D102
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if now - self._drawn_at < REDRAW_SECONDS and batch_idx + 1 < self.total_train_batches:
            return  # the next redraw sets the bar to its batch: nothing is lost by skipping this one
        self._drawn_at = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
