"""What this box can start: its devices (GPUs, or CPU cores for gloo processes) and the threads a CPU rank gets.

A Plan (`plan.py`) says what a run asks for; these say whether this box can start it, and with how many threads.
"""

from __future__ import annotations

import os

from hslite.errors import ConfigError
from hslite.parallel.plan import Accelerator, Plan

CPU_PROCESSES_PER_CORE = 2  # gloo ranks a fit may start per core: enough to measure sharing, not to thrash


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


def resolve_accelerator(accelerator: str) -> Accelerator:
    """'auto' becomes 'gpu' when CUDA is available, else 'cpu'; 'cpu' and 'gpu' stay; anything else is refused."""
    if accelerator == "auto":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator == "gpu":
        return "gpu"
    if accelerator == "cpu":
        return "cpu"
    raise ConfigError(f"parallel.accelerator must be auto, cpu or gpu, got {accelerator!r}.")


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
