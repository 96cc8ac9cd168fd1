"""The Lightning Trainer arguments that run a Plan: accelerator, strategy (spawned or launched), callbacks, deadlines.

`plan.py` says what a run asks for and `box.py` what this box can start; this turns a Plan into Lightning's parts.
"""

from __future__ import annotations

from typing import Any

from hslite.parallel.box import threads_per_process
from hslite.parallel.deadlines import DEFAULT_DEADLINES, Deadlines
from hslite.parallel.plan import Plan


def trainer_kwargs(
    plan: Plan,
    progress: bool = True,
    deterministic: bool = False,
    launched: bool = False,
    deadlines: Deadlines = DEFAULT_DEADLINES,
) -> dict[str, Any]:
    """Lightning Trainer arguments for a Plan: accelerator, devices, strategy, precision, accumulation, callbacks.

    Several ranks run Lightning DDP launched by spawning: `fit` stays a library call whose process holds the data and
    the reports, and the trained weights come back to it. `launched`: a launcher started every rank
    (`parallel.launched`), so none is spawned. CPU ranks use gloo with cores ÷ N threads each. `deadlines`: how long
    the ranks' process group waits at start-up, in a collective and at a fence (`deadlines.py`).
    """
    from hslite.parallel.progress_bar import RedrawnProgressBar

    callbacks: list[Any] = [RedrawnProgressBar(leave=True)] if progress else []
    kwargs: dict[str, Any] = {
        "accelerator": plan.accelerator,
        "devices": plan.devices,
        "num_nodes": plan.num_nodes,
        "precision": plan.precision,
        "accumulate_grad_batches": plan.accumulate,
        "enable_progress_bar": progress,
        "enable_model_summary": False,
        "strategy": "auto",
    }
    if plan.world_size > 1 and plan.fsdp:
        kwargs["strategy"] = _sharded_strategy(plan, launched, deadlines)
    elif plan.world_size > 1:
        kwargs["strategy"] = _ddp_strategy(plan, launched, deadlines)
        if plan.compression_enabled:
            from hslite.parallel.compression.guard import CompressionGuard

            # Against its own best val/OA: two validations in a row more than 1 point below it relax one level.
            callbacks.append(CompressionGuard("val/OA", tolerance_points=1.0, patience=2))
    from hslite.parallel.ranks.rank_setup import RankSetup

    threads = threads_per_process(plan) if plan.accelerator == "cpu" else None
    spawned = plan.world_size > 1 and not launched
    callbacks.append(RankSetup(threads, deterministic, plan.tf32, plan.cudnn_benchmark, spawned=spawned))
    kwargs["callbacks"] = callbacks
    return kwargs


def process_group_backend(accelerator: str) -> str:
    """The torch.distributed backend of a plan's process groups: gloo on CPU; on GPUs NCCL and gloo, by tensor device.

    Why a backend per device type rather than NCCL alone: hslite hands collectives host-side values (the timing and
    usage figures every rank reduces once an epoch, the random state and compression residuals a checkpoint gathers)
    and an NCCL-only group has no CPU backend ("No backend type associated with device type cpu"). Moving them to the
    GPU would add a host-device sync for figures that live on the host. With "cpu:gloo,cuda:nccl" every tensor goes
    where it lives: gradients, tokens and FSDP shards over NCCL, host figures over gloo; object collectives and
    barriers take gloo too (torch picks "cpu" for them when a group has it), so they allocate no CUDA memory, and
    Sub-groups (DeviceMesh, `new_group`) inherit the pair. Barriers do not: Lightning binds the group to the rank's
    GPU, and torch sends a bound group's barrier over the bound device (NCCL); hslite's fences have a gloo group of
    their own (`deadlines.fence`).
    """
    return "gloo" if accelerator == "cpu" else "cpu:gloo,cuda:nccl"


def _sharded_strategy(plan: Plan, launched: bool, deadlines: Deadlines) -> Any:
    from hslite.parallel.strategies.fsdp import ShardedStrategy

    backend = process_group_backend(plan.accelerator)
    replicas = plan.num_nodes if plan.hybrid_shard else 1
    return ShardedStrategy(plan.world_size, plan.precision, backend, spawn=not launched, replicas=replicas,
                           deadlines=deadlines)  # fmt: skip


def _ddp_strategy(plan: Plan, launched: bool, deadlines: Deadlines) -> Any:
    from hslite.parallel.strategies.ddp import FencedDDPStrategy

    options: dict[str, Any] = {
        "start_method": "popen" if launched else "spawn",  # "popen" starts no process where the launcher did
        "process_group_backend": process_group_backend(plan.accelerator),
        "deadlines": deadlines,
    }
    if plan.rotation_enabled or plan.chag_enabled:
        # A band group's own parameters go unused in a step that leaves it out, or on a rank that does not own it.
        options["find_unused_parameters"] = True
    if plan.chag_enabled:
        from hslite.parallel.channels.channel_groups import ChannelGroupCompressedDDPStrategy, ChannelGroupDDPStrategy

        if plan.compression_enabled:
            return ChannelGroupCompressedDDPStrategy(plan.chag, compression=plan.compression, **options)
        return ChannelGroupDDPStrategy(plan.chag, **options)
    if plan.compression_enabled:
        from hslite.parallel.strategies.ddp import CompressedDDPStrategy

        return CompressedDDPStrategy(plan.compression, **options)
    return FencedDDPStrategy(**options)
