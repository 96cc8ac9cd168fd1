"""Band groups' own gradients summed over the ranks that own them, not all-reduced as zeros over every rank.

Under channel groups a band group's own parameters (`group_parameters(g)`: on channel_vit its band embeddings,
query and spectral projection) take part in the forward of the one chag rank that owns the group; on the chag − 1
others their gradient is zero. DDP would all-reduce those zeros over all dp × chag ranks. Here they are left out of
DDP (`_ddp_params_and_buffers_to_ignore`) and summed over the owner's dp peers only (the mesh's dp sub-group: the
ranks with the same chag index), once per optimiser step, after the backward that syncs (none under accumulation's
no_sync). A rank sends 2(dp − 1)/dp of its own groups' gradient bytes instead of 2(N − 1)/N of every group's, and
nothing at dp = 1. Scaled as DDP would: the owner's gradient is chag × its dp shard's (channel_groups.py), so the
sum over dp peers is divided by N = dp × chag.

Replicas. A rank updates only the groups it owns; the others' copies go stale on it, unused by its forward. Where
the whole model is read (a checkpoint, the end of training) `sync_replicas` all-gathers each group's parameters and
optimiser state from its owner over the chag group, so every rank, and rank 0's checkpoint, holds the trained model.
`broadcast_initial` hands rank 0's group parameters to all, as DDP does for the parameters it manages.

Rank-local gradients change two things that read gradients across parameters: a gradient norm (norm clipping is
refused by the strategy) and fp16 loss scaling, whose overflow check must agree on every rank (`reduce` spreads an
overflow seen in one rank's groups to all, so every scaler skips that step alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.parallel.wire_format import wire_bytes


def group_parameters(model: nn.Module, group: int) -> list[nn.Parameter]:
    """Band group `group`'s own parameters: a band-group model's `group_parameters(group)`, checked."""
    method = getattr(model, "group_parameters", None)
    if not callable(method):
        raise ConfigError(
            f"{type(model).__name__} has no group_parameters(group_index): a band-group model names the parameters "
            "only one group's encode_group uses (README 'Your own model'), so channel groups reduce them over the "
            "ranks that own the group."
        )
    return list(method(group))


class GroupGradients:
    """One rank's band-group parameters: which it owns, their reduction over dp peers, and the replicas' sync."""

    def __init__(
        self,
        model: nn.Module,
        owners: Sequence[Sequence[int]],
        chag_rank: int,
        dp_group: Any,
        chag_group: Any,
        world_size: int,
    ) -> None:
        self.groups = [group_parameters(model, g) for g in range(sum(len(owned) for owned in owners))]
        self.owners, self.chag_rank = [list(owned) for owned in owners], chag_rank
        self.dp_group, self.chag_group, self.world_size = dp_group, chag_group, world_size
        self.owned = [p for g in self.owners[chag_rank] for p in self.groups[g]]
        self.dp = dist.get_world_size(dp_group)
        # Bytes this rank's reductions moved (ring all-reduce, per rank), summed over calls: what the pre-flight
        # prices as the band groups' share of Prediction.grad_bytes_per_step.
        self.bytes_sent = 0

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Every group's own parameters, owned here or not: those DDP leaves alone."""
        return [p for params in self.groups for p in params]

    def ignored_names(self, module: nn.Module) -> list[str]:
        """Names in `module` (the one DDP wraps) of every group's own parameters."""
        mine = {id(p) for p in self.parameters}
        return [name for name, p in module.named_parameters() if id(p) in mine]

    def broadcast_initial(self) -> None:
        """Every rank starts from rank 0's group parameters, as DDP starts the rest."""
        with torch.no_grad():
            for p in self.parameters:
                dist.broadcast(p, src=0)

    def reduce(self, check_overflow: bool = False) -> None:
        """Sum the owned groups' gradients over the dp peers, divided by dp × chag (DDP's mean, see module notes).

        Rotation leaves a step's inactive groups without gradients on every dp peer alike, so the peers flatten the
        same tensors. With `check_overflow` (fp16 loss scaling) an inf or NaN in any rank's groups becomes NaN in
        every rank's, so all scalers skip the step.
        """
        grads = [p.grad for p in self.owned if p.grad is not None]
        if check_overflow:
            self._agree_on_overflow(grads)
        if not grads or self.dp == 1:
            if grads:
                torch._foreach_div_(grads, self.world_size / self.dp)  # a sum over one dp rank: DDP's mean
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.world_size)
        dist.all_reduce(flat, group=self.dp_group)
        self.bytes_sent += wire_bytes(flat.numel(), self.dp, "none")
        torch._foreach_copy_(
            grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
        )

    def _agree_on_overflow(self, grads: list[Tensor]) -> None:
        device = grads[0].device if grads else next(iter(self.parameters)).device
        local = torch.stack([g.isfinite().all() for g in grads]).all() if grads else torch.tensor(True, device=device)
        overflow = (~local).to(torch.float32).reshape(1)
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        if overflow.item() and grads:  # a host sync, only under fp16 loss scaling
            torch._foreach_mul_(grads, float("nan"))

    def sync_replicas(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Every rank takes each group's parameters and optimiser state from the group's owner (chag all-gather)."""
        mine = {g: self._group_state(g, optimizers) for g in self.owners[self.chag_rank]}
        gathered: list[Any] = [None] * dist.get_world_size(self.chag_group)
        dist.all_gather_object(gathered, mine, group=self.chag_group)
        with torch.no_grad():
            for rank, states in enumerate(gathered):
                if rank == self.chag_rank:
                    continue
                for g, (values, optimizer_states) in states.items():
                    for p, value, state in zip(self.groups[g], values, optimizer_states, strict=True):
                        p.copy_(value)
                        self._put_state(p, state, optimizers)

    def _group_state(self, group: int, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[list[Tensor], list[Any]]:
        values = [p.detach().cpu() for p in self.groups[group]]
        states = []
        for p in self.groups[group]:
            state = next((o.state[p] for o in optimizers if p in o.state), None)
            states.append(None if state is None else {k: _to_cpu(v) for k, v in state.items()})
        return values, states

    @staticmethod
    def _put_state(p: Tensor, state: dict[str, Any] | None, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if state is None:
            return
        for optimizer in optimizers:
            if any(p is q for group in optimizer.param_groups for q in group["params"]):
                optimizer.state[p] = {k: _to_device(v, p) for k, v in state.items()}


def _to_cpu(value: Any) -> Any:
    return (value.detach().cpu(), value.device.type) if isinstance(value, Tensor) else value


def _to_device(value: Any, p: Tensor) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Tensor):
        tensor, device_type = value
        return tensor.to(p.device if device_type == p.device.type else "cpu")
    return value
