"""How long a multi-process run waits, phase by phase, and the fence that waits over gloo on every device.

One deadline for everything does not fit: on GPUs the process group's timeout is NCCL's watchdog limit, whose answer
is SIGABRT of every rank, so a short one kills healthy jobs (cuDNN autotuning a 3-D convolution on the first step,
rank 0 writing a checkpoint to network storage, the first placement of a large cube), and a long one leaves a hung
rank's job waiting. hslite therefore waits per phase (`Deadlines`, the recipe's `parallel.deadlines.*`):

- **startup**: the rendezvous and the first communicator. Lightning spawns ranks one after another, and each imports
  torch and Lightning, so many ranks on few cores take tens of seconds to meet (tests/test_deadlines.py starts 16
  on the CI's 2 cores).
- **collective**: every collective after start-up, and on GPUs NCCL's watchdog limit. Long, because a hung rank is
  not its business: the stall watch (`stall_watch.py`) ends that one within a minute.
- **fence**: a barrier that ends a phase where one rank works alone (a checkpoint, an evaluation, a map). It goes over
  a gloo group of hslite's own (`fence`), never over NCCL, so its deadline is honoured and raises instead of
  aborting.
- **stall**: how long a rank may show no sign of life (its heartbeat thread frozen: SIGSTOP, a GIL held, swapped out)
  before the launcher's watch ends it and names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hslite.errors import ConfigError


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase of a multi-process run may take before it is ended (see the module docstring)."""

    collective: float = 600.0  # torch's own NCCL default; long skews (autotuning, a rank-0 evaluation) fit under it
    startup: float = 600.0  # rendezvous + first communicator: ranks spawned one after another on a loaded box
    fence: float = 1800.0  # one rank's solo work (checkpoint on network storage, map of a large scene); Lightning's
    stall: float = 30.0  # no heartbeat this long: the rank is frozen; ended and named, the job ends within a minute

    def timedelta(self, phase: str) -> timedelta:
        """One phase's deadline as the timedelta torch.distributed takes."""
        return timedelta(seconds=getattr(self, phase))


DEFAULT_DEADLINES = Deadlines()

# The fence's own gloo group, made once per default process group (a new default group gets a new fence group).
_fence_groups: dict[int, Any] = {}


def fence_group() -> Any:
    """A gloo group of hslite's own over every rank: its barriers stay on the host wherever the default group is bound.

    Why not `dist.barrier()`: Lightning binds its group to the rank's GPU (`init_process_group(device_id=...)`), and
    torch's `barrier` then takes the bound device before the "CPU backend" rule: an NCCL all-reduce, whose per-call
    timeout is ignored and whose deadline is the watchdog's. Every rank must call this at the same point (it is a
    collective); `fence` does.
    """
    default = dist.distributed_c10d._get_default_group()
    key = id(default)
    if key not in _fence_groups:
        _fence_groups.clear()  # a destroyed default group's fence group went with it
        _fence_groups[key] = dist.new_group(backend="gloo")
    return _fence_groups[key]


def fence(seconds: float = DEFAULT_DEADLINES.fence) -> None:
    """Wait until every rank of the default group is here, at most `seconds`; over gloo on every device.

    A rank that does not come in time makes every rank raise, rank 0 naming the ranks missing
    (`monitored_barrier`), instead of an NCCL watchdog abort; a rank that died closes its connections and ends the
    wait at once.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    dist.monitored_barrier(fence_group(), timeout=timedelta(seconds=seconds), wait_all_ranks=True)


def set_collective_deadline(seconds: float) -> None:
    """Give the default group (every backend in it, NCCL's watchdog included) the collective deadline after start-up."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


class FencedBarrier:
    """Lightning's `barrier` hook as a `fence`, and the phase deadlines of a strategy (a mixin of hslite's strategies).

    `deadlines=` is taken from the strategy's keyword arguments: the group is created with the start-up deadline
    (Lightning's `timeout`), which turns into the collective deadline once the group exists; Lightning's barriers
    (after a checkpoint, before teardown) become fences with the fence deadline.
    """

    def __init__(self, *args: Any, deadlines: Deadlines = DEFAULT_DEADLINES, **kwargs: Any) -> None:
        if "timeout" in kwargs:
            raise ConfigError(
                f"{type(self).__name__} waits per phase: pass deadlines=Deadlines(startup=..., collective=..., "
                f"fence=...) (hslite.strategies.Deadlines, seconds) instead of timeout={kwargs['timeout']!r}."
            )
        self.deadlines = deadlines
        super().__init__(*args, **{**kwargs, "timeout": deadlines.timedelta("startup")})  # type: ignore[call-arg]

    def setup_environment(self) -> None:  # noqa: D102 - Lightning's hook; the group exists once it returns
        super().setup_environment()  # type: ignore[misc]
        if dist.is_available() and dist.is_initialized():
            set_collective_deadline(self.deadlines.collective)

    def barrier(self, name: str | None = None) -> None:  # noqa: D102 - Lightning's hook, over gloo with its deadline
        fence(self.deadlines.fence)
