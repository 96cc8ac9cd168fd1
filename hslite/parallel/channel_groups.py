"""Channel groups (D-CHAG-lite): a band-group model's fixed groups split across the ranks of a chag sub-group.

Ranks form a (dp, chag) mesh, row-major: global rank = dp_rank × chag + chag_rank, so one chag group is `chag`
consecutive ranks, and those ranks see the same samples (the sampler follows the dp index). Forward on a rank:
encode only its own G/chag groups (their tokenizer work and activations), all-gather the (n, G/chag, L, D) group
tokens over its chag group with autograd, then aggregate and head over all G groups, replicated in the chag group.

Gradients, with DDP averaging every gradient over all dp × chag ranks: the all-gather's backward reduce-scatters,
summing the token gradient of every chag rank into each rank's slice, so the tokenizer's gradient on a rank is
chag × its groups' share, and the average over the chag ranks adds the shares up; the replicated aggregation and
head give every chag rank the same gradient, which the average keeps. Every rank thus ends with the gradient of one
process over the dp ranks' samples (exact in fp32 up to summation order; tests/test_channel_groups.py). A group's
own parameters are unused on the ranks that do not own it, so DDP runs with find_unused_parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from hslite.errors import ConfigError
from hslite.parallel.strategies import CompressedDDPStrategy


class BandGroupModel(Protocol):
    """What channel groups and rotation need of a model: its groups and the three stages between them."""

    band_groups: list[tuple[int, int]]

    def encode_groups(self, x: Tensor, group_indices: Sequence[int]) -> Tensor:
        """The given groups' tokens from patches with every band (n, B, p, p) -> (n, len(group_indices), L, D)."""
        ...

    def aggregate(self, group_tokens: Tensor, group_indices: Sequence[int]) -> Tensor:
        """The given groups' tokens (n, G', L, D) -> (n, L, D)."""
        ...

    def head(self, tokens: Tensor) -> Tensor:
        """(n, L, D) -> logits (n, classes)."""
        ...


class _GatherGroupTokens(torch.autograd.Function):
    """All-gather (n, g, L, D) tokens along the group dimension; backward reduce-scatters (sums) the gradient.

    torch.distributed.nn.functional.all_gather does the same but is deprecated (for private functional
    collectives) and, over gloo, emulates the reduce-scatter with an all-to-all of every gradient chunk.
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, counter: ChannelGroups) -> Tensor:
        ctx.group, ctx.counter = group, counter
        ranks = dist.get_world_size(group)
        n, g = local.shape[:2]
        gathered = local.new_empty((ranks * n, *local.shape[1:]))  # rank after rank along the first dimension
        dist.all_gather_single(gathered, local.contiguous(), group=group)
        counter.bytes_collected += gathered.numel() * gathered.element_size()
        return gathered.view(ranks, *local.shape).transpose(0, 1).reshape(n, ranks * g, *local.shape[2:])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ranks = dist.get_world_size(ctx.group)
        n, total = grad.shape[:2]
        per_rank = grad.reshape(n, ranks, total // ranks, *grad.shape[2:]).transpose(0, 1).contiguous()
        local = grad.new_empty(per_rank.shape[1:])
        dist.reduce_scatter_single(local, per_rank.view(ranks * n, *per_rank.shape[2:]), group=ctx.group)
        ctx.counter.bytes_collected += per_rank.numel() * per_rank.element_size()
        return local, None, None


def check_divides(num_groups: int, chag: int) -> None:
    """Raise ConfigError unless chag divides the model's band groups, naming the values that would."""
    if num_groups % chag:
        factors = [f for f in range(1, num_groups + 1) if num_groups % f == 0]
        raise ConfigError(
            f"parallel.chag={chag} must divide the model's {num_groups} band groups (each rank owns the same number): "
            f"use chag in {factors}, or set model num_groups to a multiple of {chag}."
        )


class ChannelGroups:
    """The forward of one chag rank: its own band groups, all-gathered group tokens, the shared rest.

    `group` is the chag sub-group (None: the default group, all ranks). `active`, when given, is the step's band
    groups under channel-subset rotation: the same number on every rank of the chag group (see rotation.py).
    """

    def __init__(self, num_groups: int, chag: int, chag_rank: int, group: Any = None) -> None:
        check_divides(num_groups, chag)
        per_rank = num_groups // chag
        self.num_groups, self.chag, self.chag_rank, self.group = num_groups, chag, chag_rank, group
        self.owned = list(range(chag_rank * per_rank, (chag_rank + 1) * per_rank))
        # Bytes of the gathered group tokens and of their gradient's reduce-scatter input, summed over calls: the
        # size the pre-flight prices (Prediction.chag_bytes_per_step).
        self.bytes_collected = 0

    def __call__(self, model: BandGroupModel, x: Tensor, active: Sequence[int] | None = None) -> Tensor:
        """Logits (n, classes) of `model` (a band-group model) for patches x (n, B, p, p)."""
        groups = self.owned if active is None else sorted(set(self.owned) & set(active))
        local = model.encode_groups(x, groups)
        tokens = _GatherGroupTokens.apply(local, self.group, self)  # rank order is group order
        indices = sorted(active) if active is not None else list(range(self.num_groups))
        return model.head(model.aggregate(tokens, indices))


class ChannelGroupDDPStrategy(DDPStrategy):
    """Lightning DDP over a (dp, chag) mesh: band groups split within each chag group (see the module notes)."""

    def __init__(self, chag: int, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "find_unused_parameters": True})  # groups are unused on ranks not owning them
        self.chag = chag
        self._chag_group: Any = None

    def setup_environment(self) -> None:
        """Start the process group as Lightning does, then the (dp, chag) mesh on it."""
        super().setup_environment()
        if self.world_size % self.chag:
            raise ConfigError(f"dp × chag must equal the {self.world_size} ranks; chag={self.chag} does not divide it.")
        device = "cuda" if self.root_device.type == "cuda" else "cpu"
        mesh = init_device_mesh(device, (self.world_size // self.chag, self.chag), mesh_dim_names=("dp", "chag"))
        self._chag_group = mesh.get_group("chag")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One shard of the data per dp index: the ranks of one chag group read the same samples."""
        return {"num_replicas": self.world_size // self.chag, "rank": self.global_rank // self.chag}

    def setup(self, trainer: Any) -> None:
        """Give the task its channel-group forward before DDP wraps it."""
        model = getattr(trainer.lightning_module, "model", None)
        band_groups = getattr(model, "band_groups", None)
        if band_groups is None:
            raise ConfigError(
                f"parallel.chag={self.chag} needs a model with band groups (channel_vit); "
                f"{type(model).__name__} has none. Set parallel.chag=1 or model.name=channel_vit."
            )
        trainer.lightning_module.channel_groups = ChannelGroups(
            len(band_groups), self.chag, self.global_rank % self.chag, self._chag_group
        )
        super().setup(trainer)


class ChannelGroupCompressedDDPStrategy(ChannelGroupDDPStrategy, CompressedDDPStrategy):
    """The same, with hslite's compressed gradient all-reduce (`compression=` as for CompressedDDPStrategy)."""
