"""FSDP units as a model declares them, and `fully_shard` applied by them (torch only; no Lightning here).

A model class names its units in `FSDP_UNITS` (submodule names; a ModuleList stands for each of its items), chosen so
each unit carries a real share of the parameters (its all-gather is not all latency) and tiny layers stay with the
root, which holds the rest; a model that declares none cannot be sharded (there is no table of model classes here).
A unit's parameters are all-gathered just before it runs and freed after, so the largest units bound the transient
memory the pre-flight adds to a rank's 1/N shard (`gathered_param_bytes`), which the probe counts without starting
any process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PREFETCHED_UNITS = 2  # FSDP2 gathers the next unit while one runs: two units are whole at once


def units(model: nn.Module) -> list[nn.Module]:
    """The modules `shard_model` wraps one by one, in order: those `model` declares in its class's FSDP_UNITS."""
    names = getattr(type(model), "FSDP_UNITS", None)
    if not names:
        raise TypeError(
            f"{type(model).__name__} declares no FSDP units, so FSDP cannot shard it; give the class "
            "FSDP_UNITS = (names of the submodules that should each be gathered on their own, e.g. its blocks)"
        )
    out: list[nn.Module] = []
    for name in names:
        child = getattr(model, name)
        out += list(child) if isinstance(child, nn.ModuleList) else [child]
    return out


def unit_count(model: nn.Module) -> int:
    """FSDP units `shard_model` makes of `model`, the root included: each gathers and reduce-scatters on its own."""
    return len(units(model)) + 1


def gathered_param_bytes(model: nn.Module) -> int:
    """Parameter bytes whole at once on a rank under FSDP: the root's own plus the two largest units, unsharded."""
    unit_bytes = sorted((_param_bytes(unit) for unit in units(model)), reverse=True)
    root_bytes = _param_bytes(model) - sum(unit_bytes)
    return root_bytes + sum(unit_bytes[:PREFETCHED_UNITS])


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def shard_model(model: nn.Module, mesh: DeviceMesh, precision: str) -> None:
    """Apply `fully_shard` to each unit of `model`, then to `model` itself; bf16 compute under bf16-mixed."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if isinstance(model, FSDPModule):  # Lightning calls configure_model again on a second fit/test in the ranks
        return
    policy = MixedPrecisionPolicy()
    if precision == "bf16-mixed":  # gathers and computes in bf16, reduces gradients and keeps the shards in fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
