"""Checkpoints that survive a crash and a choice of "best" that does not stop at the first saturated epoch.

Lightning's own save writes through fsspec into a temporary file under /tmp and then moves it, which is a copy
(not atomic) when /tmp is another filesystem, and never fsyncs: a `kill -9` or power cut mid-write can leave a
truncated `best.ckpt`. Here a checkpoint is written beside its final name, fsynced, renamed over it and the folder
fsynced, so the previous file stays loadable until the new one is whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from hslite.atomic import atomic_write


def atomic_torch_save(payload: Any, path: Path) -> None:
    """torch.save to a temporary file in the target folder, fsync, rename over `path`, fsync the folder."""
    atomic_write(path, lambda f: torch.save(payload, f))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO whose saves are atomic on a local filesystem (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write `checkpoint` to `path` atomically."""
        atomic_torch_save(checkpoint, Path(path))


class BestCheckpoint(ModelCheckpoint):
    """The best epoch by `val/OA`, a tie going to the later epoch, plus `last.ckpt` at every validation.

    On a small validation set OA saturates early; Lightning's strict comparison would then keep the first epoch that
    reached it and test an under-trained model. The later of two equal epochs has trained longer at a lower rate.
    """

    def __init__(self, dirpath: Path) -> None:
        super().__init__(dirpath=dirpath, filename="best", monitor="val/OA", mode="max", save_top_k=1, save_last=True)

    def check_monitor_top_k(self, trainer: pl.Trainer, current: torch.Tensor | None = None) -> bool:
        """Save when `current` beats or equals the best so far (ranks decide together)."""
        if current is not None and self.best_k_models:
            tie = bool(current == self.best_k_models[self.kth_best_model_path])
            if trainer.strategy.reduce_boolean_decision(tie):
                return True
        return super().check_monitor_top_k(trainer, current)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model state of a checkpoint, read with `weights_only=True` (no code runs while loading)."""
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
