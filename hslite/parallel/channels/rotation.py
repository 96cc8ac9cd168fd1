"""Channel-subset rotation: k of G band groups take part in each optimiser step, in a schedule every rank knows.

The schedule is a function of the step and the seed alone, so ranks agree without communicating and a resumed run
continues it. Steps come in cycles of ⌈G/k⌉: each cycle draws a permutation of the groups (from the seed and the
cycle number) and walks it k at a time, so every group is active at least once per cycle; a short last slice is
filled from the start of the permutation. Under channel groups each chag rank draws its k/chag groups from its
own G/chag, so every rank encodes the same number of groups and the token exchange stays rectangular.

Band-group models (channel_vit) encode only the active groups: fewer tokens, less compute and memory, and the
inactive groups' own parameters get no gradient, so the optimiser leaves them and their moments alone that step
(no momentum decay, no weight decay). Other models see the inactive groups' bands zeroed and the active ones scaled
by B / active bands, as inverted dropout does; that saves nothing, and the pre-flight prices it so.

Evaluation uses every band. A band-group model is evaluated as the ensemble it was trained as: every group is encoded
once, and the class probabilities are averaged over the group subsets training draws (`evaluation_subsets`). Its
across-group attention never saw all G groups at once in training, and fed them all it falls apart: on unseen
blocks of a synthetic scene it scored well under half the ensemble of pairs' OA, and the ensemble matched the same
model trained on every group. Masked models see every band, unscaled, as after inverted dropout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.parallel.channels.group_owners import rank_groups


def check_rotation(num_groups: int, active: int, chag: int = 1) -> None:
    """Raise ConfigError unless `active` of `num_groups` groups can rotate, chag ranks sharing them evenly."""
    if not 1 <= active < num_groups:
        raise ConfigError(
            f"parallel.rotation_groups={active} must be between 1 and {num_groups - 1}: the model has {num_groups} "
            "band groups and rotation keeps fewer of them active per step (0 turns it off)."
        )
    if active % chag:
        choices = [k for k in range(chag, num_groups, chag)]
        raise ConfigError(
            f"parallel.rotation_groups={active} must be a multiple of parallel.chag={chag}, so every channel-group "
            f"rank encodes as many groups per step: use one of {choices}."
        )


DEFAULT_GROUPS = 4  # for models without band groups of their own: one per spectral region
MAX_EVALUATION_SUBSETS = 16  # beyond C(G, k) = 16 (G=8, k=4 has 70), the first distinct subsets the schedule draws


class RotationSchedule:
    """Which band groups are active at each optimiser step, and a model's forward with only those."""

    def __init__(self, band_groups: Sequence[tuple[int, int]], active: int, seed: int, chag: int = 1) -> None:
        check_rotation(len(band_groups), active, chag)
        self.band_groups = list(band_groups)
        self.num_groups, self.active, self.seed, self.chag = len(band_groups), active, seed, chag
        self.owners = rank_groups([stop - start for start, stop in self.band_groups], chag)  # as channel groups
        self.per_rank = self.num_groups // chag
        self.active_per_rank = active // chag
        self.steps_per_cycle = math.ceil(self.per_rank / self.active_per_rank)  # = ⌈G/k⌉

    def active_groups(self, step: int) -> list[int]:
        """The sorted active groups at optimiser step `step` (the same on every rank)."""
        cycle, position = divmod(step, self.steps_per_cycle)
        order = np.random.default_rng([self.seed, cycle]).permutation(self.per_rank)
        slots = np.arange(position * self.active_per_rank, (position + 1) * self.active_per_rank) % self.per_rank
        return sorted(owned[i] for owned in self.owners for i in order[slots])

    def forward(self, model: nn.Module, x: Tensor, active: Sequence[int]) -> Tensor:
        """Logits of `model` for patches x (n, B, p, p) with only the `active` band groups taking part."""
        if hasattr(model, "encode_groups"):  # a band-group model encodes only the active groups
            return model(x, active)
        mask = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
        for g in active:
            mask[self.band_groups[g][0] : self.band_groups[g][1]] = 1.0
        return model(x * (mask * (x.shape[1] / mask.sum()))[None, :, None, None])

    def evaluation_subsets(self) -> list[list[int]]:
        """The group subsets evaluation averages over: every one training can draw, or the first 16 it draws."""
        choices = itertools.combinations(range(self.per_rank), self.active_per_rank)
        every = [sorted(owned[i] for owned in self.owners for i in chosen) for chosen in choices]
        if len(every) <= MAX_EVALUATION_SUBSETS:
            return every
        drawn: list[list[int]] = []
        step = 0
        while len(drawn) < MAX_EVALUATION_SUBSETS:
            if (active := self.active_groups(step)) not in drawn:
                drawn.append(active)
            step += 1
        return drawn

    def evaluate(self, model: nn.Module, x: Tensor, grouped: Callable[..., Tensor] | None = None) -> Tensor:
        """Evaluation logits: log of the class probabilities averaged over `evaluation_subsets` (band-group models).

        `grouped` is the channel-group forward under chag (each subset then encodes its groups on their ranks);
        without it every group is encoded once and only aggregation and head run per subset. Masked models see
        every band.
        """
        if not hasattr(model, "encode_groups"):
            return model(x)
        subsets = self.evaluation_subsets()
        if grouped is not None:
            logits = [grouped(model, x, subset) for subset in subsets]
        else:
            banded: Any = model  # the band-group protocol (models/band_groups.py), which nn.Module does not declare
            tokens = banded.encode_groups(x, range(self.num_groups))
            logits = [banded.head(banded.aggregate(tokens[:, subset], subset)) for subset in subsets]
        return torch.stack([z.log_softmax(dim=-1) for z in logits]).logsumexp(dim=0) - math.log(len(logits))


class SubsetEnsemble(nn.Module):
    """A band-group model trained under rotation, called as evaluation calls it (`hslite predict` loads runs so)."""

    def __init__(self, model: nn.Module, schedule: RotationSchedule) -> None:
        super().__init__()
        self.model, self.schedule = model, schedule

    def forward(self, x: Tensor) -> Tensor:
        """Evaluation logits: `RotationSchedule.evaluate` of the wrapped model."""
        return self.schedule.evaluate(self.model, x)
