"""What a checkpoint needs beyond Lightning's own state for a resumed run to draw the numbers an uninterrupted one does.

Lightning restores the model, optimiser, scheduler, loops and callbacks, but no random state, and only rank 0 writes the
file. Each rank's torch (CPU, and CUDA on its own GPU: dropout masks are drawn there), NumPy and Python generators and
its training set's augmentation generator are gathered into rank 0's checkpoint here (a few KB per rank), with the run's
config so that a checkpoint of another run is recognised. The global generators are put back as Lightning restores the
checkpoint: a resumed fit skips the sanity check and makes its first epoch's iterator (which draws the shuffle's seed)
before any hook of training runs, where an uninterrupted one makes it after the previous epoch's checkpoint. The
augmentation generator, which only the batches draw from, is put back when training starts, once the training set is
loaded. A compressing strategy's per-rank state (its residuals) rides in the same gather, so a checkpoint costs one
collective; the strategy restores it (`CompressedDDPStrategy.load_checkpoint`).
"""

from __future__ import annotations

import random
from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch

from hslite.errors import DataError
from hslite.parallel.strategies.ddp import CompressedDDPStrategy, gather_from_ranks

CHECKPOINT_KEY = "hslite"


def _rank_state(trainer: pl.Trainer) -> dict[str, Any]:
    _, keys, position, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },  # tensors and numbers: weights_only loads them
        "python": random.getstate(),
    }
    device = trainer.strategy.root_device
    if device.type == "cuda":  # this rank's GPU only: reading another's would start a CUDA context there
        state["cuda"] = torch.cuda.get_rng_state(device)
    generator = _augmentation_generator(trainer)
    if generator is not None:
        state["augmentation"] = generator.get_state()
    return state


def _set_global_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:  # a CPU run's checkpoint has none: other kernels draw anyway
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["gauss"]))
    random.setstate(_as_tuples(state["python"]))


def _as_tuples(value: Any) -> Any:
    # random.setstate wants the tuples it gave; a checkpoint read back may hold lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _augmentation_generator(trainer: pl.Trainer) -> torch.Generator | None:
    loader = trainer.train_dataloader
    dataset = getattr(loader, "dataset", None)
    return getattr(dataset, "augmentation_generator", None)


class TrainingState(pl.Callback):
    """Save every rank's random state and the run's config in each checkpoint; restore them on resume."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._augmentation: torch.Tensor | None = None  # from a checkpoint, until the training set is loaded

    def on_save_checkpoint(  # noqa: D102 - Lightning calls it on every rank, so the gather is collective
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        compressing = trainer.strategy if isinstance(trainer.strategy, CompressedDDPStrategy) else None
        theirs = (
            compressing.rank_state() if compressing is not None else None
        )  # rides in this gather: one per checkpoint
        # Every rank's on rank 0, which alone writes the file; none elsewhere, where the keys still go in, so that the
        # strategy's save_checkpoint sees them on every rank and none of them gathers again.
        states = gather_from_ranks((_rank_state(trainer), theirs))
        checkpoint[CHECKPOINT_KEY] = {"config": self.config, "ranks": [own for own, _ in states]}
        if compressing is not None:
            compressing.put_rank_states(checkpoint, [theirs for _, theirs in states])

    def on_load_checkpoint(  # noqa: D102
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        ranks = checkpoint.get(CHECKPOINT_KEY, {}).get("ranks", [])
        if len(ranks) != trainer.world_size:
            raise DataError(
                f"the checkpoint holds the random state of {len(ranks)} ranks and this run has {trainer.world_size}; "
                "resume it with the plan it was written with."
            )
        state = ranks[trainer.global_rank]
        _set_global_state(state, trainer.strategy.root_device)
        self._augmentation = state.get("augmentation")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        generator = _augmentation_generator(trainer)
        if generator is not None and self._augmentation is not None:
            generator.set_state(self._augmentation)
        self._augmentation = None
