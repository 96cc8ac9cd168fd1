"""A LightningModule's own training step, batches and model copies, for the probe of a team's own script.

The probe of a Lightning script must time what that script trains: the module's `training_step` (its loss, its
extra terms, whatever it logs) and the optimiser its `configure_optimizers` returns, on batches shaped like its
DataModule's. `lightning_workload` turns a module and one batch into what `probe_model` takes; each measurement
gets a fresh copy of the module, with `self.log` silenced (no Trainer is attached while the probe runs).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.utilities.data import extract_batch_size
from lightning_utilities import apply_to_collection
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.preflight_check.measure.training_step import TrainingStep


@dataclass(frozen=True)
class Workload:
    """What the probe runs of a team's module: fresh copies of it, batches of any size, and its training step."""

    model_factory: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    step: TrainingStep
    batch_size: int  # rows of the batch it was made from: the script's per-device micro-batch


def lightning_workload(module: pl.LightningModule, batch: Any) -> Workload:
    """The probe's view of `module` trained on batches like `batch` (one batch of its training DataLoader).

    Refused in a sentence, before anything is timed: manual optimisation, a `training_step` that is not the
    module's own, one whose output has no loss to backpropagate, or more than one optimiser.
    """
    name = type(module).__name__
    if not isinstance(module, pl.LightningModule):
        raise ConfigError(f"the pre-flight of a script takes a LightningModule, got {type(module).__name__}.")
    if type(module).training_step is pl.LightningModule.training_step:
        raise ConfigError(f"{name} has no training_step of its own; the probe times the step your module defines.")
    if not module.automatic_optimization:
        raise ConfigError(
            f"{name} uses manual optimisation (automatic_optimization = False): its training_step steps optimisers "
            "through the Trainer, which the probe cannot time without one; price it with automatic optimisation."
        )
    template = copy.deepcopy(module).cpu()  # what it is now, before training changes it
    rows = batch_rows(batch)

    def model_factory() -> nn.Module:
        probe_copy = copy.deepcopy(template)
        probe_copy.log = _not_logged  # type: ignore[method-assign]
        probe_copy.log_dict = _not_logged  # type: ignore[method-assign]
        return probe_copy

    def make_batch(batch_size: int) -> Any:
        # The batch's own rows, cycled: the shapes and dtypes training sees, at any batch size.
        index = torch.arange(batch_size) % rows
        return apply_to_collection(batch, Tensor, lambda t: t[index] if t.dim() and len(t) == rows else t)

    step = TrainingStep(module_loss, module_optimizer, f"LightningModule {type(module).__qualname__}")
    workload = Workload(model_factory, make_batch, step, rows)
    module_optimizer(model_factory())  # configure_optimizers' problems are said now, not in the middle of a probe
    return workload


def batch_rows(batch: Any) -> int:
    """Samples in `batch`, as Lightning counts them (the first per-sample tensor's length)."""
    with warnings.catch_warnings():
        # Lightning warns that a dict batch is ambiguous and advises self.log(batch_size=...), which is not ours
        warnings.filterwarnings("ignore", message=".*infer the `batch_size`")
        return extract_batch_size(batch)


def module_loss(module: nn.Module, batch: Any) -> Tensor:
    """The loss `module.training_step(batch, 0)` returns: a tensor, or the "loss" of the dict it returns."""
    name = type(module).__name__
    try:
        out = module.training_step(batch, 0)  # type: ignore[operator]
    except RuntimeError as err:
        if "not attached to a `Trainer`" not in str(err):
            raise
        raise ConfigError(
            f"{name}.training_step reads self.trainer, which the probe does not attach ({err}); read what you need "
            "in setup() or pass it to the module, so its step runs on a batch alone."
        ) from err
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad):
        raise ConfigError(
            f"{name}.training_step returned {_described(out)}; the probe times the step Lightning runs, which "
            "backpropagates the loss it returns: return a scalar tensor that requires grad, or a dict with it under "
            "'loss'."
        )
    return loss


def module_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """The one optimiser `module.configure_optimizers()` returns, in any form Lightning accepts."""
    name = type(module).__name__
    try:
        optimizers, _, _ = _configure_optimizers(module.configure_optimizers())  # type: ignore[operator]
    except RuntimeError as err:
        if "not attached to a `Trainer`" not in str(err):
            raise
        raise ConfigError(
            f"{name}.configure_optimizers reads self.trainer, which the probe does not attach ({err}); build the "
            "optimiser from the module's own hyper-parameters."
        ) from err
    if len(optimizers) != 1:
        raise ConfigError(
            f"{name}.configure_optimizers returned {len(optimizers)} optimisers; the probe times a step with one "
            "(Lightning's automatic optimisation takes one too)."
        )
    return optimizers[0]


def _not_logged(*_: Any, **__: Any) -> None:
    """`self.log` while the probe runs: nothing to log to, and nothing the timing should include."""


def _described(value: Any) -> str:
    if torch.is_tensor(value):
        grad = "requires grad" if value.requires_grad else "does not require grad"
        return f"a tensor of shape {tuple(value.shape)} that {grad}"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}" + ("" if "loss" in value else " and no 'loss'")
    return f"{type(value).__name__} {value!r}"[:120]
