"""What the probe repeats as "one training step": a model's loss on a batch and the optimiser that steps it.

Every measurement of the pre-flight (step times, sizes, FLOPs, the tokenizer's share, FSDP's and contention's
costs) runs the step it is handed, so what is priced is what trains: hslite's classifier step (`CLASSIFIER_STEP`,
cross-entropy of `model(x)` against `y` and hslite's AdamW) for the recipes, or a LightningModule's own
`training_step` and `configure_optimizers` (`own_script/lightning_step.py`) for a team's own script. A batch is
whatever the step takes (a tuple, a dict, ...); its tensors are moved and counted wherever they sit in it. The
functions are module-level so that a step pickles into the processes that time contention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities import apply_to_collection
from torch import Tensor, nn

from hslite.optim import adamw


@dataclass(frozen=True)
class TrainingStep:
    """A training step as the probe runs it."""

    loss: Callable[[nn.Module, Any], Tensor]  # the forward of a batch with its loss
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]  # builds the optimiser that steps the model
    label: str  # which step it is, in cache keys and reports


def classifier_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The task loss of hslite: cross-entropy of the logits of the patches against their labels."""
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def classifier_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The task optimiser of hslite (`hslite.optim.adamw`)."""
    return adamw(model.parameters())


CLASSIFIER_STEP = TrainingStep(classifier_loss, classifier_optimizer, "hslite classifier")


def batch_to(batch: Any, dev: torch.device) -> Any:
    """`batch` with every tensor in it on `dev`."""
    return apply_to_collection(batch, Tensor, lambda t: t.to(dev, non_blocking=True))


def batch_bytes(batch: Any) -> int:
    """Bytes of all the tensors in `batch`: what a step copies from host to device."""
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)
