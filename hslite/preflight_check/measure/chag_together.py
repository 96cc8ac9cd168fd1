"""Channel groups timed in the ranks of `ranks_together`: each dp × chag mesh of them, as the strategy runs it.

The forward `ChannelGroupDDPStrategy` gives the task (its own band groups, the token all-to-all, the rest on its
slice of the samples, the loss share), in DDP with the band groups' own parameters left out and the gradient hook
that waits for the exchange (`exchange_order`), the groups' own gradients summed over their owners before the
optimiser steps, and the plan's rotation of band groups, over the ranks' gloo groups. What the parts' pricing
cannot see on a CPU box is in it: the exchange's latency on cores that also compute, DDP's unused-parameter
search, the buckets held back until the exchange, the Python of the split. hslite's classifier step only (the
recipes' band-group models); a team's own training_step is priced from the parts.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hslite.parallel.channels.channel_groups import ChannelGroups
from hslite.parallel.channels.exchange_order import ExchangeOrder, ordered_hook
from hslite.parallel.channels.group_gradients import GroupGradients
from hslite.parallel.channels.rotation import RotationSchedule
from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP, TrainingStep


def chag_layouts(step: TrainingStep, band_group_sizes: list[int] | None, ranks: int, rotation: int) -> list[int]:
    """The chag sizes `ranks` ranks time (each a dp × chag mesh): those ≥ 2 that divide the ranks and the groups.

    hslite's classifier step only; under rotation of `rotation` groups, those whose ranks share them evenly.
    """
    if step.label != CLASSIFIER_STEP.label or not band_group_sizes:
        return []
    groups = len(band_group_sizes)
    return [c for c in range(2, ranks + 1) if ranks % c == 0 and groups % c == 0 and rotation % c == 0]


class _GroupedLoss(nn.Module):
    """One chag rank's forward and loss share, as the task computes them under a channel-group strategy."""

    def __init__(self, model: nn.Module, groups: ChannelGroups, rotation: RotationSchedule | None) -> None:
        super().__init__()
        self.model: Any = model  # a band-group model (channel_groups.BandGroupModel)
        self.groups, self.rotation, self.steps = groups, rotation, 0

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        active = self.rotation.active_groups(self.steps) if self.rotation is not None else None
        self.steps += 1
        return self.groups.loss_share(nn.CrossEntropyLoss(), self.groups(self.model, x, active), y)


class _ReducingOptimizer:
    """The optimiser, stepping once the band groups' own gradients are summed over their owners.

    The strategy sums them in post_backward; here the timed optimiser step holds that reduction.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradients: GroupGradients) -> None:
        self.optimizer, self.gradients = optimizer, gradients

    def step(self) -> None:
        self.gradients.reduce()
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def chag_step(
    model: nn.Module, band_group_sizes: list[int], rank: int, ranks: int, chag: int, rotation: int
) -> tuple[nn.Module, Any]:
    """(the module to step, its optimiser) for this rank in a (ranks/chag, chag) mesh; a collective on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    grouped = copy.deepcopy(model).train()
    mesh = init_device_mesh("cpu", (ranks // chag, chag), mesh_dim_names=("dp", "chag"))
    chag_group, dp_group = mesh.get_group("chag"), mesh.get_group("dp")
    groups = ChannelGroups(band_group_sizes, chag, rank % chag, chag_group)
    gradients = GroupGradients(grouped, groups.owners, rank % chag, dp_group, chag_group, ranks)
    band_groups: list[tuple[int, int]] = grouped.band_groups  # type: ignore[assignment]  # a band-group model
    schedule = RotationSchedule(band_groups, rotation, seed=0, chag=chag) if rotation else None
    forward = _GroupedLoss(grouped, groups, schedule)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(forward, gradients.ignored_names(forward))
    ddp = DistributedDataParallel(forward, find_unused_parameters=True)
    groups.order = ExchangeOrder(None, default_hooks.allreduce_hook)
    ddp.register_comm_hook(groups.order, ordered_hook)
    return ddp, _ReducingOptimizer(CLASSIFIER_STEP.optimizer(grouped), gradients)
