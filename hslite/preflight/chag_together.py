"""Channel groups timed in the ranks of `ranks_together`: every rank one chag rank (dp 1), as the strategy runs them.

The forward `ChannelGroupDDPStrategy` gives the task (its own band groups, the token all-to-all, the rest on its
slice of the samples, the loss share), in DDP with the band groups' own parameters left out and the gradient hook
that waits for the exchange (`exchange_order`), over the ranks' gloo group. What the parts' pricing cannot see on
a CPU box is in it: the exchange's latency on cores that also compute, DDP's unused-parameter search, the buckets
held back until the exchange, the Python of the split. hslite's classifier step only (the recipes' band-group
models); a team's own training_step is priced from the parts.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hslite.parallel.channel_groups import ChannelGroups
from hslite.parallel.exchange_order import ExchangeOrder, ordered_hook
from hslite.parallel.group_gradients import GroupGradients
from hslite.preflight.training_step import CLASSIFIER_STEP, TrainingStep


def chag_measurable(step: TrainingStep, band_group_sizes: list[int] | None, ranks: int) -> bool:
    """Whether `ranks` ranks can time the channel-group step: hslite's step, band groups that the ranks divide."""
    return step.label == CLASSIFIER_STEP.label and bool(band_group_sizes) and len(band_group_sizes or []) % ranks == 0


class _GroupedLoss(nn.Module):
    """One chag rank's forward and loss share, as the task computes them under a channel-group strategy."""

    def __init__(self, model: nn.Module, groups: ChannelGroups) -> None:
        super().__init__()
        self.model: Any = model  # a band-group model (channel_groups.BandGroupModel)
        self.groups = groups

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return self.groups.loss_share(nn.CrossEntropyLoss(), self.groups(self.model, x), y)


def chag_step(model: nn.Module, band_group_sizes: list[int], rank: int, ranks: int) -> tuple[nn.Module, Any]:
    """(the module to step, its optimiser) for this rank as chag rank `rank` of `ranks` (dp 1); a collective."""
    grouped = copy.deepcopy(model).train()
    singletons = [dist.new_group([r]) for r in range(ranks)]  # each rank's dp group: every rank creates every group
    groups = ChannelGroups(band_group_sizes, ranks, rank)
    gradients = GroupGradients(grouped, groups.owners, rank, singletons[rank], None, ranks)
    forward = _GroupedLoss(grouped, groups)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(forward, gradients.ignored_names(forward))
    ddp = DistributedDataParallel(forward, find_unused_parameters=True)
    groups.order = ExchangeOrder(None, default_hooks.allreduce_hook)
    ddp.register_comm_hook(groups.order, ordered_hook)
    return ddp, CLASSIFIER_STEP.optimizer(grouped)
