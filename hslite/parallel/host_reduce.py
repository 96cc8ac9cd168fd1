"""The element-wise max over every rank of figures that live on the host (timings, memory), with no barrier first.

Lightning's `strategy.reduce` opens with `torch.distributed.barrier()`; on a group Lightning bound to the rank's GPU
that barrier is an NCCL all-reduce (torch takes the bound device for barriers), a host-device sync and an NCCL
watchdog entry for a few host numbers. hslite's groups have a gloo half for host tensors
(`trainer_args.process_group_backend`), so the figures are reduced there directly; a group of NCCL alone (a team's
own DDPStrategy("nccl")) has no CPU backend, and there they go through the rank's GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """`values` (a host tensor) reduced by max over every rank of the default group; itself without one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    backend = str(dist.get_backend())
    where = values if "gloo" in backend else values.to(torch.device("cuda", torch.cuda.current_device()))
    reduced = where.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.to(values.device)
