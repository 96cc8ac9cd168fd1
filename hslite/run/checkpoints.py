"""Checkpoints that survive a crash and a choice of "best" that does not stop at the first saturated epoch.

Lightning's own save writes through fsspec into a temporary file under /tmp and then moves it, which is a copy
(not atomic) when /tmp is another filesystem, and never fsyncs: a `kill -9` or power cut mid-write can leave a
truncated `best.ckpt`. Here a checkpoint is written beside its final name, fsynced, renamed over it and the folder
fsynced, so the previous file stays loadable until the new one is whole.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from hslite.atomic import atomic_write
from hslite.errors import DataError, unreadable


def atomic_torch_save(payload: Any, path: Path) -> None:
    """torch.save to a temporary file in the target folder, fsync, rename over `path`, fsync the folder."""
    atomic_write(path, lambda f: torch.save(payload, f))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO whose saves are atomic on a local filesystem (see the module docstring).

    `already_read` holds, by path, the bytes of checkpoints the caller read before handing the path to Lightning (a
    resumed run's last.ckpt, whose config is checked before the run starts): every rank loads them instead of reading
    the file again. Bytes, not the loaded checkpoint: they reach a spawned rank through its pipe as they are, where each
    of a loaded checkpoint's tensors would take a shared-memory file descriptor. (FSDP's ModelParallelStrategy reads
    its checkpoint itself, not through this plugin.)
    """

    def __init__(self, already_read: dict[Path, bytes] | None = None) -> None:
        super().__init__()
        self.already_read = already_read or {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write `checkpoint` to `path` atomically."""
        atomic_torch_save(checkpoint, Path(path))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint with `weights_only=True` whatever the caller asks: loading never runs code."""
        path = Path(path)
        # Popped: Lightning restores from it once, and the rank need not hold the bytes for the rest of training.
        return read_checkpoint(path, self.already_read.pop(path, None))


class BestCheckpoint(ModelCheckpoint):
    """The best epoch by `val/OA`, a tie going to the later epoch.

    On a small validation set OA saturates early; Lightning's strict comparison would then keep the first epoch that
    reached it and test an under-trained model. The later of two equal epochs has trained longer at a lower rate.
    """

    def __init__(self, dirpath: Path) -> None:
        super().__init__(dirpath=dirpath, filename="best", monitor="val/OA", mode="max", save_top_k=1)

    def check_monitor_top_k(self, trainer: pl.Trainer, current: torch.Tensor | None = None) -> bool:
        """Save when `current` beats or equals the best so far (ranks decide together)."""
        if current is not None and self.best_k_models:
            tie = bool(current == self.best_k_models[self.kth_best_model_path])
            if trainer.strategy.reduce_boolean_decision(tie):
                return True
        return super().check_monitor_top_k(trainer, current)


class LastCheckpoint(Checkpoint):
    """`last.ckpt` every `every_n_epochs` epochs and after the last, at the epoch's end (after its validation).

    What `resume=` reads. A `Checkpoint`, so Lightning runs it after the module's own epoch-end hook, as it runs
    ModelCheckpoint; that class itself writes `last` only in an epoch where it also wrote a top-k file.
    """

    def __init__(self, path: Path, every_n_epochs: int) -> None:
        self.path = path
        self.every_n_epochs = every_n_epochs

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        epoch = trainer.current_epoch + 1
        if epoch % self.every_n_epochs == 0 or epoch == trainer.max_epochs:
            trainer.save_checkpoint(
                self.path, weights_only=False
            )  # on every rank: the state of every rank is gathered into it


def read_checkpoint(path: Path, data: bytes | None = None) -> dict[str, Any]:
    """A whole checkpoint loaded with `weights_only=True`; a missing or unreadable file is a DataError saying so.

    `data` is the file's bytes when they were read already (a resumed run's last.ckpt: `AtomicCheckpointIO`).
    """
    if data is None and not path.is_file():
        raise DataError(f"checkpoint {path} does not exist.")
    try:
        return torch.load(path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, KeyError) as err:
        why, cause = unreadable(err)
        raise DataError(
            f"checkpoint {path}: {why}; it is truncated, corrupt or not a checkpoint hslite wrote (a run's "
            "checkpoints/best.ckpt or last.ckpt, written atomically: this one was damaged or replaced since)."
        ) from cause


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model state of a checkpoint, read with `weights_only=True` (no code runs while loading)."""
    checkpoint = read_checkpoint(path)
    if "state_dict" not in checkpoint:
        raise DataError(f"checkpoint {path} holds no model state (no 'state_dict'); it is not a Lightning checkpoint.")
    return checkpoint["state_dict"]
