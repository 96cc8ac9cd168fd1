"""Channel groups (D-CHAG-lite): a band-group model's fixed groups split across the ranks of a chag sub-group.

Ranks form a (dp, chag) mesh, row-major: global rank = dp_rank × chag + chag_rank, so one chag group is `chag`
consecutive ranks, and those ranks see the same samples (the sampler follows the dp index). Forward on a rank:
encode its own G/chag groups (bands balanced, group_owners.py) for the whole batch (their tokenizer work and
activations), exchange group tokens over its chag group with autograd (an all-to-all: each rank sends every other
rank the tokens of that rank's slice of the samples, and receives its own slice's tokens of every group), then
aggregate over all G groups and run the head on its slice only: n/chag samples. D-CHAG replicates that rest on
every chag rank; splitting it by samples divides its compute and activations by chag as well and moves 1/chag of
the bytes an all-gather would.

Gradients: a rank's loss is its samples' share of the batch loss times chag (`loss_share`), so DDP's average over
all dp × chag ranks gives the shared parameters the batch's gradient; the exchange's backward returns every slice's
token gradient to the group's owner, whose group-parameter gradient is then chag × its dp shard's. Those are
summed over the owner's dp peers only and divided by dp × chag (group_gradients.py), not all-reduced as zeros over
every rank. Every rank thus ends with the gradient of one process over the dp ranks' samples for what it uses
(exact in fp32 up to summation order; tests/test_channel_groups.py). Rotation leaves some groups' shared
parameters unused in a step, so DDP runs with find_unused_parameters, and its gradient hook waits for the exchange
so that every rank issues the two communicators' collectives in one order (exchange_order.py: NCCL hangs
otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from hslite.errors import ConfigError
from hslite.parallel.channels.exchange_order import ExchangeOrder, ordered_hook
from hslite.parallel.channels.group_gradients import GroupGradients
from hslite.parallel.channels.group_owners import rank_groups
from hslite.parallel.strategies.ddp import CompressedDDPStrategy, FencedDDPStrategy


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


class _ExchangeGroupTokens(torch.autograd.Function):
    """All-to-all: this rank's g groups for all n samples (n, g, L, D) -> every group for its own samples (m, G, L, D).

    `splits` are the samples each rank of the group keeps, in rank order (m = splits[rank]). Backward is the reverse
    exchange: each rank's gradient for the tokens of its samples goes back to the ranks that own those groups. An
    all-gather of all the tokens would move chag times the bytes, to feed a replicated rest that only needs a slice.
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, splits: list[int], counter: ChannelGroups) -> Tensor:
        ranks, mine = len(splits), splits[dist.get_rank(group)]
        ctx.group, ctx.splits, ctx.mine, ctx.counter = group, splits, mine, counter
        received = local.new_empty((ranks * mine, *local.shape[1:]))  # rank after rank along the first dimension
        dist.all_to_all_single(received, local.contiguous(), [mine] * ranks, splits, group=group)
        counter.bytes_received += received.numel() * received.element_size()
        g = local.shape[1]
        return received.view(ranks, mine, *local.shape[1:]).transpose(0, 1).reshape(mine, ranks * g, *local.shape[2:])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        ranks, mine = len(ctx.splits), ctx.mine
        g = grad.shape[1] // ranks
        per_rank = (
            grad.reshape(mine, ranks, g, *grad.shape[2:]).transpose(0, 1).reshape(ranks * mine, g, *grad.shape[2:])
        )
        local = grad.new_empty((sum(ctx.splits), g, *grad.shape[2:]))
        dist.all_to_all_single(local, per_rank.contiguous(), ctx.splits, [mine] * ranks, group=ctx.group)
        ctx.counter.bytes_received += local.numel() * local.element_size()
        if ctx.counter.order is not None:
            ctx.counter.order.exchanged()
        return local, None, None, None


def check_divides(num_groups: int, chag: int) -> None:
    """Raise ConfigError unless chag divides the model's band groups, naming the values that would."""
    if num_groups % chag:
        factors = [f for f in range(1, num_groups + 1) if num_groups % f == 0]
        raise ConfigError(
            f"parallel.chag={chag} must divide the model's {num_groups} band groups (each rank owns the same number): "
            f"use chag in {factors}, or set model num_groups to a multiple of {chag}."
        )


class ChannelGroups:
    """The forward of one chag rank: its own band groups for the batch, exchanged tokens, the rest for its samples.

    `group` is the chag sub-group (None: the default group, all ranks). `active`, when given, is the step's band
    groups under channel-subset rotation: the same number on every rank of the chag group (see rotation.py).
    """

    def __init__(
        self,
        group_sizes: Sequence[int],
        chag: int,
        chag_rank: int,
        group: Any = None,
        order: ExchangeOrder | None = None,
    ) -> None:
        check_divides(len(group_sizes), chag)
        self.chag, self.chag_rank, self.group = chag, chag_rank, group
        self.order = order  # DDP's gradient hook state, told when the exchange's backward has run
        self.owners = rank_groups(group_sizes, chag)  # bands balanced across the ranks
        self.owned = self.owners[chag_rank]
        # Bytes the token exchange writes on this rank (forward tokens, backward gradients), summed over calls: the
        # size the pre-flight prices (Prediction.chag_bytes_per_step).
        self.bytes_received = 0

    def sample_splits(self, n: int) -> list[int]:
        """Samples of an n-sample batch each chag rank runs the rest of the model on (sizes differ by at most one)."""
        base, extra = divmod(n, self.chag)
        return [base + (rank < extra) for rank in range(self.chag)]

    def own_samples(self, batch: Tensor) -> Tensor:
        """The rows of a batch (every chag rank holds it whole) that this rank runs the rest of the model on."""
        splits = self.sample_splits(len(batch))
        start = sum(splits[: self.chag_rank])
        return batch[start : start + splits[self.chag_rank]]

    def __call__(self, model: BandGroupModel, x: Tensor, active: Sequence[int] | None = None) -> Tensor:
        """Logits (m, classes) of `model` (a band-group model) for this rank's m samples of patches x (n, B, p, p)."""
        taking_part = [[g for g in owned if active is None or g in active] for owned in self.owners]
        if self.order is not None and torch.is_grad_enabled():
            self.order.step_started()
        local = model.encode_groups(x, taking_part[self.chag_rank])
        tokens = _ExchangeGroupTokens.apply(local, self.group, self.sample_splits(len(x)), self)
        return model.head(model.aggregate(tokens, [g for owned in taking_part for g in owned]))  # in rank order

    def loss_share(self, loss: nn.CrossEntropyLoss, logits: Tensor, targets: Tensor) -> Tensor:
        """The share of the whole batch's `loss` on this rank, for its logits and the batch's `targets` (all n).

        `loss`'s mean is over the whole batch's labelled samples, weighted by class: its weighted sum over this
        rank's samples, divided by the batch's total weight, times chag because DDP averages over the chag ranks
        whose shares add up to the batch loss. It estimates the batch loss from this rank's samples, as a DDP rank's
        loss does from its shard; DDP's mean of it is the batch loss exactly.
        """
        own = self.own_samples(targets)
        summed = nn.functional.cross_entropy(
            logits, own, weight=loss.weight, ignore_index=loss.ignore_index, reduction="sum"
        )
        # No boolean-mask indexing: its output size is data-dependent, a host-device sync on every step on a GPU.
        labelled = targets != loss.ignore_index
        if loss.weight is None:
            total = labelled.sum()
        else:
            total = torch.where(labelled, loss.weight[targets.where(labelled, 0)], 0).sum()
        return summed * self.chag / total


class ChannelGroupDDPStrategy(FencedDDPStrategy):
    """Lightning DDP over a (dp, chag) mesh: band groups split within each chag group (see the module notes)."""

    def __init__(self, chag: int, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "find_unused_parameters": True})  # groups are unused on ranks not owning them
        self.chag = chag
        self._chag_group: Any = None
        self._dp_group: Any = None
        self._order: ExchangeOrder | None = None
        self.group_gradients: GroupGradients | None = None  # set up with the model

    def setup_environment(self) -> None:
        """Start the process group as Lightning does, then the (dp, chag) mesh on it."""
        super().setup_environment()
        if self.world_size % self.chag:
            raise ConfigError(f"dp × chag must equal the {self.world_size} ranks; chag={self.chag} does not divide it.")
        device = "cuda" if self.root_device.type == "cuda" else "cpu"
        mesh = init_device_mesh(device, (self.world_size // self.chag, self.chag), mesh_dim_names=("dp", "chag"))
        self._chag_group, self._dp_group = mesh.get_group("chag"), mesh.get_group("dp")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One shard of the data per dp index: the ranks of one chag group read the same samples."""
        return {"num_replicas": self.world_size // self.chag, "rank": self.global_rank // self.chag}

    def setup(self, trainer: Any) -> None:
        """Give the task its channel-group forward before DDP wraps it."""
        model = getattr(trainer.lightning_module, "model", None)
        band_groups = getattr(model, "band_groups", None)
        if not isinstance(model, nn.Module) or band_groups is None:
            raise ConfigError(
                f"parallel.chag={self.chag} needs a model with band groups (channel_vit); "
                f"{type(model).__name__} has none. Set parallel.chag=1 or model.name=channel_vit."
            )
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":
            raise ConfigError(
                f"parallel.chag={self.chag} keeps each band group's gradient on the ranks that own it, so a gradient "
                f"norm would differ by rank; got gradient_clip_val={trainer.gradient_clip_val} by "
                f"{trainer.gradient_clip_algorithm}. Clip by value (gradient_clip_algorithm='value') or not at all."
            )
        sizes = [stop - start for start, stop in band_groups]
        self._order = None
        chag_rank = self.global_rank % self.chag
        groups = ChannelGroups(sizes, self.chag, chag_rank, self._chag_group)
        trainer.lightning_module.channel_groups = groups
        self.group_gradients = GroupGradients(
            model, groups.owners, chag_rank, self._dp_group, self._chag_group, self.world_size
        )
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """Wrap the model in DDP, then make its gradient all-reduce wait for the token exchange (exchange_order.py).

        A compressed all-reduce (the subclass below) registers its hook through `_register_hook`, which wraps it;
        otherwise the plain all-reduce is wrapped here.
        """
        if self.group_gradients is not None and self.model is not None:  # summed over owners (group_gradients.py)
            names = self.group_gradients.ignored_names(self.model)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.model, names)
            self.group_gradients.broadcast_initial()
        super().configure_ddp()
        if self._order is None:
            ddp = self.model
            if not isinstance(ddp, DistributedDataParallel):
                raise RuntimeError(f"expected the model wrapped in DistributedDataParallel, got {type(ddp).__name__}")
            self._register_hook(ddp, None, default_hooks.allreduce_hook)

    def post_backward(self, closure_loss: Tensor) -> None:
        """After the backward that syncs DDP's gradients (not an accumulated one), sum the groups' own over owners."""
        super().post_backward(closure_loss)
        ddp = self.model
        if self.group_gradients is not None and isinstance(ddp, DistributedDataParallel):
            if ddp.require_backward_grad_sync:
                self.group_gradients.reduce(check_overflow=self.precision_plugin.precision == "16-mixed")

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model: every group's parameters and optimiser state from its owner first (on every rank)."""
        self._sync_group_replicas()
        return super().lightning_module_state_dict()

    def on_train_end(self) -> None:
        """Leave every rank with the trained model, whoever owned each group."""
        self._sync_group_replicas()
        super().on_train_end()

    def _sync_group_replicas(self) -> None:
        if self.group_gradients is not None:
            self.group_gradients.sync_replicas(self.optimizers)

    def _register_hook(self, ddp: DistributedDataParallel, state: Any, hook: Any) -> None:
        self._order = ExchangeOrder(state, hook)
        ddp.register_comm_hook(self._order, ordered_hook)
        groups = getattr(self.lightning_module, "channel_groups", None)
        if groups is not None:
            groups.order = self._order


class ChannelGroupCompressedDDPStrategy(ChannelGroupDDPStrategy, CompressedDDPStrategy):
    """The same, with hslite's compressed gradient all-reduce (`compression=` as for CompressedDDPStrategy)."""
