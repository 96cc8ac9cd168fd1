"""The Plan: how one run is laid out over devices, validated before any process group exists.

A Plan is the single description of a layout that the pre-flight check prices and that `trainer_kwargs` turns into
Lightning Trainer arguments; nothing else in hslite decides devices, precision or strategy. Plans are built from
plain arguments (`hslite.recipe.build.plan_from_config` reads a recipe into one), so this package never sees a Config.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any

from hslite.errors import ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
COMPRESSIONS = ("none", "int8", "bf16", "fp16")
CPU_PROCESSES_PER_CORE = 2  # gloo ranks a fit may start per core: enough to measure sharing, not to thrash


@dataclass(frozen=True)
class Plan:
    """One layout of a training run over devices.

    world_size = devices × num_nodes = dp × chag; global batch = dp × batch_size × accumulate.
    """

    devices: int = 1  # devices (GPUs, or CPU processes) per node
    num_nodes: int = 1  # nodes; more than 1 runs under a launcher (torchrun, srun: `launched.py`), hslite starts none
    accelerator: str = "cpu"  # "cpu" (gloo processes) or "gpu" (NCCL)
    batch_size: int = 64  # per-device micro-batch, samples
    accumulate: int = 1  # micro-batches per optimiser step; 1 means no accumulation
    precision: str = "32-true"  # Lightning precision string
    compression: str = "none"  # gradient all-reduce compression; "none" means plain fp32 all-reduce
    chag: int = 1  # ranks that split one sample batch's band groups; 1 means no channel parallelism
    rotation_groups: int = 0  # band groups active per step under channel-subset rotation; 0 means off
    fsdp: bool = False  # shard parameters, gradients and optimiser state across the data-parallel ranks
    tf32: bool = True  # CUDA only: fp32 matmuls and convolutions on TF32 tensor cores; False means full fp32
    cudnn_benchmark: bool = True  # CUDA only: cuDNN times its kernels for each new input shape; False means heuristics

    @property
    def world_size(self) -> int:
        """Ranks in the whole run."""
        return self.devices * self.num_nodes

    @property
    def dp(self) -> int:
        """Data-parallel replicas (ranks that see different samples)."""
        return self.world_size // self.chag

    @property
    def global_batch(self) -> int:
        """Samples per optimiser step across all ranks."""
        return self.dp * self.batch_size * self.accumulate

    @property
    def dp_enabled(self) -> bool:
        """Whether gradients are averaged across replicas."""
        return self.dp > 1

    @property
    def chag_enabled(self) -> bool:
        """Whether band groups are split across ranks."""
        return self.chag > 1

    @property
    def rotation_enabled(self) -> bool:
        """Whether only a subset of band groups is active per step."""
        return self.rotation_groups > 0

    @property
    def compression_enabled(self) -> bool:
        """Whether the gradient all-reduce is compressed."""
        return self.compression != "none"

    def validate(self) -> Plan:
        """Raise ConfigError naming every factor when the layout is inconsistent; return self otherwise."""
        problems = []
        for name in ("devices", "num_nodes", "batch_size", "accumulate", "chag"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.accelerator not in ("cpu", "gpu"):
            problems.append(f"accelerator must be 'cpu' or 'gpu', got {self.accelerator!r}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.compression not in COMPRESSIONS:
            problems.append(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.rotation_groups < 0:
            problems.append(f"rotation_groups must be ≥ 0 (0 means off), got {self.rotation_groups}")
        if not problems and self.world_size % self.chag:
            problems.append(
                f"dp × chag must equal devices × num_nodes: devices({self.devices}) × num_nodes({self.num_nodes}) = "
                f"{self.world_size} is not divisible by chag({self.chag})"
            )
        if not problems and self.compression_enabled and self.fsdp:
            problems.append("compression and fsdp cannot be combined: FSDP reduce-scatters gradients itself")
        if not problems and self.fsdp and self.precision == "16-mixed":
            problems.append(
                "fsdp cannot train in precision 16-mixed (Lightning's FSDP2 strategy has no fp16 loss scaler): use "
                "parallel.precision=bf16-mixed or 32-true"
            )
        if not problems and self.fsdp and (self.chag_enabled or self.rotation_enabled):
            problems.append(
                "fsdp cannot be combined with chag or rotation_groups: their band groups' parameters go unused on "
                "some ranks or steps, which FSDP's per-unit reduce-scatter does not allow for; choose one"
            )
        if problems:
            raise ConfigError("invalid parallel plan: " + "; ".join(problems) + ".")
        return self

    def single_device(self) -> Plan:
        """The same per-device batch and precision on one device: how evaluation and prediction run."""
        return Plan(
            accelerator=self.accelerator,
            batch_size=self.batch_size,
            precision=self.precision,
            tf32=self.tf32,
            cudnn_benchmark=self.cudnn_benchmark,
        )

    def overrides(self) -> str:
        """The `key=value` overrides that ask `hslite fit` for this plan (the fields that set the layout)."""
        return (
            f"parallel.devices={self.devices} data.batch_size={self.batch_size} parallel.accumulate={self.accumulate} "
            f"parallel.precision={self.precision} parallel.compression={self.compression} parallel.chag={self.chag} "
            f"parallel.rotation_groups={self.rotation_groups} parallel.fsdp={str(self.fsdp).lower()}"
            + "".join(f" parallel.{name}=false" for name in ("tf32", "cudnn_benchmark") if not getattr(self, name))
        )

    def describe(self) -> str:
        """Short human label, e.g. '4×cpu dp4 b64 acc1 32-true'."""
        parts = [f"{self.world_size}×{self.accelerator}", f"dp{self.dp}"]
        if self.chag_enabled:
            parts.append(f"chag{self.chag}")
        parts += [f"b{self.batch_size}", f"acc{self.accumulate}", self.precision]
        if self.compression_enabled:
            parts.append(self.compression)
        if self.rotation_enabled:
            parts.append(f"rot{self.rotation_groups}")
        if self.fsdp:
            parts.append("fsdp")
        return " ".join(parts)

    def with_(self, **changes: Any) -> Plan:
        """A validated copy with some fields changed."""
        return replace(self, **changes).validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON reports."""
        return asdict(self)


def visible_devices(accelerator: str) -> int:
    """How many devices of this kind the box has: CUDA devices, or CPU cores for gloo processes."""
    if accelerator == "gpu":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return len(os.sched_getaffinity(0))


def threads_per_process(plan: Plan, cores: int | None = None) -> int:
    """CPU threads one rank of `plan` gets on this node: usable cores ÷ processes, at least 1.

    Usable cores come from the affinity mask, which is what a container really grants.
    """
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // plan.devices)


def resolve_accelerator(accelerator: str) -> str:
    """'auto' becomes 'gpu' when CUDA is available, else 'cpu'."""
    if accelerator == "auto":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return accelerator


def startable_devices(accelerator: str) -> int:
    """The most devices per node a fit may start here: the visible GPUs, or CPU_PROCESSES_PER_CORE per CPU core."""
    have = visible_devices(accelerator)
    return have * CPU_PROCESSES_PER_CORE if accelerator == "cpu" else have


def check_visible(plan: Plan, launched: bool = False) -> Plan:
    """Refuse a plan this box cannot start, other nodes (unless `launched`) or too many devices; else return it."""
    if plan.num_nodes > 1 and not launched:
        raise ConfigError(
            f"this run asks for {plan.num_nodes} nodes, and hslite starts the ranks of one box. Launch every node "
            "with torchrun or srun (README: several nodes), or price it with `hslite preflight` and a topology "
            "profile (preflight.topology=...), or set parallel.num_nodes=1."
        )
    have = startable_devices(plan.accelerator)
    if plan.devices > have:
        kind = "GPUs" if plan.accelerator == "gpu" else f"CPU processes ({CPU_PROCESSES_PER_CORE} per core)"
        raise ConfigError(
            f"parallel.devices={plan.devices} but this box has {have} {kind} visible. "
            f"Set parallel.devices≤{max(have, 1)}"
            + (" or parallel.accelerator=cpu to run on CPU processes." if plan.accelerator == "gpu" else ".")
        )
    return plan


def trainer_kwargs(
    plan: Plan, progress: bool = True, deterministic: bool = False, launched: bool = False
) -> dict[str, Any]:
    """Lightning Trainer arguments for a Plan: accelerator, devices, strategy, precision, accumulation, callbacks.

    Several ranks run Lightning DDP launched by spawning: `fit` stays a library call whose process holds the data and
    the reports, and the trained weights come back to it. `launched`: a launcher started every rank
    (`parallel.launched`), so none is spawned. CPU ranks use gloo with cores ÷ N threads each.
    """
    from lightning.pytorch.callbacks import RichProgressBar

    callbacks: list[Any] = [RichProgressBar(leave=True)] if progress else []
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
        kwargs["strategy"] = _sharded_strategy(plan, launched)
    elif plan.world_size > 1:
        kwargs["strategy"] = _ddp_strategy(plan, launched)
        if plan.compression_enabled:
            from hslite.parallel.compression_guard import CompressionGuard

            # Against its own best val/OA: two validations in a row more than 1 point below it relax one level.
            callbacks.append(CompressionGuard("val/OA", tolerance_points=1.0, patience=2))
    from hslite.parallel.rank_setup import RankSetup

    threads = threads_per_process(plan) if plan.accelerator == "cpu" else None
    callbacks.append(RankSetup(threads, deterministic, tf32=plan.tf32, cudnn_benchmark=plan.cudnn_benchmark))
    kwargs["callbacks"] = callbacks
    return kwargs


# Every collective's deadline, and on GPUs NCCL's watchdog limit (a collective it times out aborts the waiting ranks,
# SIGABRT). A stalled rank ignores the launcher's SIGTERM and is killed 30 s later, so the job ends about 15 + 30 s
# after the stall (48 s measured here, 54.6 s with 20 s), within the minute on a loaded box (rank_watch.py). A
# training step or a validation must not keep one rank from the others longer than this; the phases where one rank
# works alone (rank 0 writing a checkpoint) end in a barrier, which waits longer (strategies.FENCE_TIMEOUT).
PROCESS_GROUP_TIMEOUT = timedelta(seconds=15)


def process_group_backend(accelerator: str) -> str:
    """The torch.distributed backend of a plan's process groups: gloo on CPU; on GPUs NCCL and gloo, by tensor device.

    Why a backend per device type rather than NCCL alone: hslite hands collectives host-side values (the timing and
    usage figures every rank reduces once an epoch, the random state and compression residuals a checkpoint gathers)
    and an NCCL-only group has no CPU backend ("No backend type associated with device type cpu"). Moving them to the
    GPU would add a host-device sync for figures that live on the host. With "cpu:gloo,cuda:nccl" every tensor goes
    where it lives: gradients, tokens and FSDP shards over NCCL, host figures over gloo; object collectives and
    barriers take gloo too (torch picks "cpu" for them when a group has it), so they allocate no CUDA memory, and
    a barrier's deadline is gloo's, not NCCL's watchdog's. Sub-groups (DeviceMesh, `new_group`) inherit the pair.
    """
    return "gloo" if accelerator == "cpu" else "cpu:gloo,cuda:nccl"


def _sharded_strategy(plan: Plan, launched: bool) -> Any:
    from hslite.parallel.fsdp import ShardedStrategy

    backend = process_group_backend(plan.accelerator)
    return ShardedStrategy(plan.world_size, plan.precision, backend, PROCESS_GROUP_TIMEOUT, spawn=not launched)


def _ddp_strategy(plan: Plan, launched: bool) -> Any:
    from hslite.parallel.strategies import FencedDDPStrategy

    options: dict[str, Any] = {
        "start_method": "popen" if launched else "spawn",  # "popen" starts no process where the launcher did
        "process_group_backend": process_group_backend(plan.accelerator),
        "timeout": PROCESS_GROUP_TIMEOUT,
    }
    if plan.rotation_enabled or plan.chag_enabled:
        # A band group's own parameters go unused in a step that leaves it out, or on a rank that does not own it.
        options["find_unused_parameters"] = True
    if plan.chag_enabled:
        from hslite.parallel.channel_groups import ChannelGroupCompressedDDPStrategy, ChannelGroupDDPStrategy

        if plan.compression_enabled:
            return ChannelGroupCompressedDDPStrategy(plan.chag, compression=plan.compression, **options)
        return ChannelGroupDDPStrategy(plan.chag, **options)
    if plan.compression_enabled:
        from hslite.parallel.strategies import CompressedDDPStrategy

        return CompressedDDPStrategy(plan.compression, **options)
    return FencedDDPStrategy(**options)
