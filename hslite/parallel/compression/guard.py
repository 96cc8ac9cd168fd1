"""CompressionGuard: step gradient compression down (int8 → bf16 → none) when validation accuracy drops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from hslite.errors import ConfigError

NEXT_LEVEL = {"int8": "bf16", "bf16": "none", "fp16": "none"}  # fp16 is as lossy as bf16 for gradients
LEVEL_BITS = {"int8": 8, "bf16": 16, "fp16": 16, "none": 32}  # logged as compression/level: bits per element sent


def kind_at_level(start: str, bits: int) -> str:
    """The compression a run that started at `start` uses once its logged `compression/level` is `bits`.

    The guard only ever moves down NEXT_LEVEL, so the kind is the first one on that path with this many bits.
    """
    kind: str | None = start
    while kind is not None:
        if LEVEL_BITS[kind] == bits:
            return kind
        kind = NEXT_LEVEL.get(kind)
    raise ConfigError(f"no compression reachable from {start!r} sends {bits} bits per element.")


class SwitchesCompression(Protocol):
    """What the guard needs of a strategy (CompressedDDPStrategy has it): the current level and a way to change it."""

    compression: str

    def set_compression(self, kind: str) -> None: ...  # noqa: D102


class CompressionGuard(Callback):
    """After each validation, compare a logged accuracy with a reference and relax compression past a tolerance.

    The reference is, in this order: `reference[epoch]` when a per-epoch curve from an uncompressed run is given,
    `reference` when it is a number, otherwise the best value this run has logged so far. When the metric is more
    than `tolerance_points` below it for `patience` validations in a row, the strategy's `set_compression` moves one
    level down (int8 → bf16 → none), the reason goes to the rank-zero log and `compression/level` (bits per gradient
    element on the wire: 8, 16, 32) to every logger after each validation.

    Ranks must switch together. The metric is identical on every rank when the module logs it with `sync_dist=True`
    (hslite's task does); the decision is also broadcast from rank 0 so that holds even when it is not.
    """

    def __init__(
        self,
        monitor: str = "val/OA",
        tolerance_points: float = 1.0,
        reference: float | Mapping[int, float] | None = None,
        patience: int = 1,
        points_per_unit: float = 100.0,  # torchmetrics accuracy is a fraction; 100 turns it into percentage points
    ) -> None:
        if tolerance_points < 0 or patience < 1:
            raise ConfigError(
                f"CompressionGuard needs tolerance_points ≥ 0 and patience ≥ 1, got {tolerance_points} and {patience}."
            )
        self.monitor = monitor
        self.tolerance_points = tolerance_points
        self.reference = reference
        self.patience = patience
        self.points_per_unit = points_per_unit
        self.best: float | None = None  # best monitored value this run
        self.below = 0  # validations in a row past the tolerance at the current level
        self.switches: list[dict[str, Any]] = []  # one record per level change, saved in checkpoints

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> SwitchesCompression:
        """The strategy as one that switches compression, which `setup` has checked."""
        return cast(SwitchesCompression, trainer.strategy)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a strategy that cannot switch compression."""
        if not callable(getattr(trainer.strategy, "set_compression", None)):
            raise ConfigError(
                f"CompressionGuard needs a strategy with set_compression (CompressedDDPStrategy), got "
                f"{type(trainer.strategy).__name__}; drop the guard or train with CompressedDDPStrategy."
            )

    def _reference(self, epoch: int) -> tuple[float | None, str]:
        if isinstance(self.reference, Mapping) and epoch in self.reference:
            return float(self.reference[epoch]), f"uncompressed reference at epoch {epoch}"
        if isinstance(self.reference, (int, float)):
            return float(self.reference), "uncompressed reference"
        return self.best, "best so far"

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Decide (rank 0's decision wins), switch, log the level."""
        if trainer.sanity_checking:
            return
        if self.monitor not in trainer.callback_metrics:
            raise ConfigError(
                f"CompressionGuard monitors {self.monitor!r}, which was not logged; logged metrics are "
                f"{', '.join(sorted(trainer.callback_metrics)) or 'none'}. Set monitor= to one of them."
            )
        value = float(trainer.callback_metrics[self.monitor])
        reference, source = self._reference(trainer.current_epoch)
        kind = self._strategy(trainer).compression
        drop_points = 0.0 if reference is None else (reference - value) * self.points_per_unit
        self.below = self.below + 1 if drop_points > self.tolerance_points else 0
        self.best = value if self.best is None else max(self.best, value)
        target = NEXT_LEVEL.get(kind) if self.below >= self.patience else None
        target = trainer.strategy.broadcast(target, src=0)
        if target is not None:
            self._strategy(trainer).set_compression(target)
            self.below = 0
            self.switches.append(
                {
                    "epoch": trainer.current_epoch,
                    "step": trainer.global_step,
                    "from": kind,
                    "to": target,
                    "value": value,
                    "reference": reference,
                }
            )
            rank_zero_info(
                f"CompressionGuard: gradient compression {kind} → {target}: {self.monitor} {value:.4f} is "
                f"{drop_points:.2f} points below the {source} {reference:.4f} for {self.patience} validation(s) "
                f"(tolerance {self.tolerance_points:.2f} points)."
            )
        bits = LEVEL_BITS[self._strategy(trainer).compression]
        trainer.callback_metrics["compression/level"] = torch.tensor(float(bits))
        for logger in trainer.loggers:
            logger.log_metrics({"compression/level": bits}, step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        """Best value, current streak and switch history (the kind itself is saved by the strategy)."""
        return {"best": self.best, "below": self.below, "switches": list(self.switches)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict saved."""
        self.best, self.below = state_dict["best"], state_dict["below"]
        self.switches = list(state_dict["switches"])
