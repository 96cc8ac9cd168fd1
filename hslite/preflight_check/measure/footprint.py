"""What one rank of a model holds: parameter, gradient, optimiser-state and saved-activation bytes, and FSDP's units.

`model_sizes` counts them on the model's own tensors (the probe calls it after timing); `measure_footprint` does
only that, on fake tensors of the model, for devices that are not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from hslite.preflight_check.measure.activations import SavedTensorCounter, measure_tokenizer
from hslite.preflight_check.measure.fake_tensors import fake_batch, fake_mode, storage_key
from hslite.preflight_check.measure.timers import autocast
from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP, TrainingStep
from hslite.preflight_check.measurements import Footprint


def measure_footprint(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], Any],
    *,
    batch_size: int,
    precision: str,
    band_group_sizes: list[int] | None = None,
    step: TrainingStep = CLASSIFIER_STEP,
) -> Footprint:
    """Bytes one rank holds at `batch_size` and `precision`, counted on fake tensors of the model (nothing allocated).

    For devices that are not here: parameters, gradients and optimiser state after one optimiser step, and the bytes
    autograd saves in a forward at `batch_size`, with the per-group work's share of them and the group tokens' size
    for a band-group model, given its `band_group_sizes` (channel groups and rotation divide those). `model_factory`
    runs inside the fake mode, so a model larger than this box is counted in seconds (`fake_tensors`). Nothing is
    timed for pricing; allocator and kernel workspace of the absent device are not known, so `peak_bytes` counts the
    four terms only.
    """
    dev = torch.device("cpu")
    with fake_mode() as mode:
        torch.manual_seed(0)
        model = model_factory().train()
        optimizer = step.optimizer(model)

        def fake_batches(b: int) -> Any:
            return fake_batch(mode, make_batch, b)

        with autocast(precision, dev):
            loss = step.loss(model, fake_batches(2))  # BatchNorm in training needs 2 samples
        loss.backward()
        optimizer.step()  # AdamW makes its state on the first step
        sizes = model_sizes(model, optimizer, fake_batches(batch_size), precision, dev, step)
        footprint = Footprint(batch_size=batch_size, precision=precision, device="cpu (sizes only)",
                              peak_bytes=counted_peak_bytes(sizes), band_group_sizes=band_group_sizes,
                              **sizes)  # fmt: skip
        if band_group_sizes:
            measure_tokenizer(footprint, model, fake_batches, precision, dev, step, forwards=1)
    return footprint


def model_sizes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    precision: str,
    dev: torch.device,
    step: TrainingStep,
) -> dict[str, Any]:  # ints, typed loosely to unpack into dataclasses with fields of other types too
    """Parameter count and bytes of parameters, gradients, `optimizer`'s state and one forward's saved activations.

    The optimiser's state is what it holds now (AdamW makes it on its first step); the activations are counted in
    a forward of `batch` on `dev` under `precision`'s autocast. FSDP's gathered bytes and units come with them.
    """
    params = list(model.parameters())
    counter = SavedTensorCounter(model)
    with autocast(precision, dev), counter:
        step.loss(model, batch)  # the graph keeps every saved storage alive, so pointers cannot be reused meanwhile
    return {
        "param_count": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),  # the params' dtype
        "optimizer_bytes": _unique_bytes(
            t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        ),
        "activation_bytes": counter.total_bytes,
        **_fsdp_sizes(model),
    }


def counted_peak_bytes(sizes: dict[str, Any]) -> int:
    """The peak as the four counted terms of `model_sizes` (no allocator or kernel workspace, which are not known)."""
    return sum(sizes[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))


def _fsdp_sizes(model: nn.Module) -> dict[str, int | None]:
    from hslite.parallel.strategies.fsdp_policy import gathered_param_bytes, unit_count

    try:
        return {"fsdp_gathered_bytes": gathered_param_bytes(model), "fsdp_units": unit_count(model)}
    except TypeError:  # no wrapping policy for this module: FSDP cannot shard it
        return {"fsdp_gathered_bytes": None, "fsdp_units": None}


def _unique_bytes(tensors: Iterator[Tensor]) -> int:
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
