"""Ranks a cluster launcher started: torchrun (TorchElastic) or SLURM's srun, on one node or several.

On one box hslite starts a plan's ranks itself (Lightning DDP by spawning: `trainer_args`). Under a launcher every
process already is a rank: `hslite fit` runs in each, and Lightning's own cluster environment for that launcher
(`TorchElasticEnvironment`, `SLURMEnvironment`; the same detection as Lightning's) gives ranks, nodes and the
rendezvous address, so nothing is spawned (the strategies' "popen" launcher, which starts no process when the
environment created them). A launcher that started one process is not a job of several: hslite spawns the plan's
ranks under it as on any box.

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m hslite.cli fit \
         recipe=salinas_16gpu parallel.num_nodes=2 parallel.devices=4

`fit` joins the job's process group before the Trainer does (Lightning finds it initialised and keeps it), so global
rank 0 can hand the others what only it decides: the run folder, the pre-flight's verdict, the final metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment

from hslite.errors import ConfigError, HSLiteError
from hslite.parallel.deadlines import DEFAULT_DEADLINES, Deadlines, fence, set_collective_deadline

T = TypeVar("T")


@dataclass(frozen=True)
class LaunchedJob:
    """The job a launcher started, as this process sees it."""

    launcher: str  # "torchrun" or "SLURM"
    environment: ClusterEnvironment
    world_size: int
    num_nodes: int
    deadlines: Deadlines = DEFAULT_DEADLINES

    @property
    def global_rank(self) -> int:
        """The rank of this process in the job."""
        return self.environment.global_rank()

    @property
    def leader(self) -> bool:
        """Global rank 0: the rank that writes the run folder and decides for all."""
        return self.global_rank == 0

    @property
    def per_node(self) -> int:
        """Ranks per node (the recipe's parallel.devices)."""
        return self.world_size // self.num_nodes

    def check(self, plan: Any) -> None:
        """One sentence, before any process group, when the recipe's world is not the one launched."""
        if self.world_size % self.num_nodes:
            raise ConfigError(
                f"{self.launcher} started {self.world_size} processes on {self.num_nodes} nodes, not as many on "
                "each; hslite trains a plan of the same devices per node: launch as many processes on every node."
            )
        if (plan.num_nodes, plan.devices) != (self.num_nodes, self.per_node):
            raise ConfigError(
                f"{self.launcher} started {self.per_node} process(es) on each of {self.num_nodes} node(s), but the "
                f"recipe asks for parallel.num_nodes={plan.num_nodes} × parallel.devices={plan.devices}. Set "
                f"parallel.num_nodes={self.num_nodes} parallel.devices={self.per_node}, or launch "
                f"{plan.devices} process(es) per node on {plan.num_nodes} node(s)."
            )

    def join(self, backend: str) -> None:
        """Initialise the job's default process group (the Trainer's strategy finds it and keeps it).

        The ranks meet under the start-up deadline (the launcher starts nodes when their allocation comes); the group
        then takes the collective deadline.
        """
        if dist.is_initialized():
            return
        os.environ["MASTER_ADDR"] = self.environment.main_address
        os.environ["MASTER_PORT"] = str(self.environment.main_port)
        if "nccl" in backend:
            import torch

            torch.cuda.set_device(self.environment.local_rank())
        timeout = self.deadlines.timedelta("startup")
        try:
            dist.init_process_group(backend, rank=self.global_rank, world_size=self.world_size, timeout=timeout)
        except dist.DistError as err:  # the store's "waiting for clients" / "connect" deadline passed
            raise ConfigError(
                f"{self.launcher} rank {self.global_rank} of {self.world_size} waited {timeout.total_seconds():.0f} s "
                "(parallel.deadlines.startup) "
                f"at {self.environment.main_address}:{self.environment.main_port} for the other ranks, and not all "
                f"came ({str(err).strip().splitlines()[0]}). Every rank must be started by the launcher: under SLURM "
                "run `srun hslite fit ...` inside the allocation (a batch script that runs hslite itself is one "
                f"process); under torchrun start an agent on each of the {self.num_nodes} node(s) with the same "
                "--rdzv-endpoint."
            ) from None
        set_collective_deadline(self.deadlines.collective)

    def placement(self) -> list[tuple[int, str]]:
        """(node, host name) of every global rank, as the launcher numbers nodes (a collective on the joined group)."""
        import socket

        where: list[Any] = [None] * self.world_size
        dist.all_gather_object(where, (self.environment.node_rank(), socket.gethostname()))
        return [(int(node), str(host)) for node, host in where]

    def from_leader(self, decide: Callable[[], T]) -> T:
        """Rank 0's `decide()` on every rank; an HSLiteError it raises is raised on every rank.

        Rank 0 may take minutes (a pre-flight probes, an evaluation maps a scene): the others wait at a fence
        (`deadlines.fence`, over gloo with parallel.deadlines.fence), not in a collective; a rank 0 that dies ends
        the wait at once (its connections close).
        """
        outcome: list[Any] = [None]
        error: HSLiteError | None = None
        if self.leader:
            try:
                outcome[0] = ("value", decide())
            except HSLiteError as err:
                error, outcome[0] = err, ("error", (type(err), str(err)))
        fence(self.deadlines.fence)
        dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if error is not None:
            raise error
        if kind == "error":
            kind_of_error, message = value
            try:
                raised = kind_of_error(message)
            except TypeError:  # an error class that takes more than its message
                raised = HSLiteError(message)
            raise raised
        return value


def launched_job(deadlines: Deadlines = DEFAULT_DEADLINES) -> LaunchedJob | None:
    """The job a launcher started this process in, or None (no launcher, or a launcher of one process)."""
    if TorchElasticEnvironment.detect():
        environment: ClusterEnvironment = TorchElasticEnvironment()
        launcher, nodes = "torchrun", os.environ.get("GROUP_WORLD_SIZE")
    elif SLURMEnvironment.detect():
        environment, launcher, nodes = SLURMEnvironment(), "SLURM", os.environ.get("SLURM_NNODES")
    else:
        return None
    world = environment.world_size()
    if world <= 1:
        return None
    return LaunchedJob(launcher, environment, world, int(nodes) if nodes else 1, deadlines)


# What torchrun and srun set for their ranks (and Lightning's environments read): a process hslite starts from a
# launched rank for work of its own is no rank of the job and must not look like one.
_LAUNCHER_VARIABLES = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
     "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"}
)  # fmt: skip
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "SLURM_")


def leave_the_job() -> None:
    """Forget the launcher in this process: its variables go, so Lightning sees a box of its own."""
    for name in [n for n in os.environ if n in _LAUNCHER_VARIABLES or n.startswith(_LAUNCHER_PREFIXES)]:
        del os.environ[name]
