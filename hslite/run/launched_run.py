"""A fit whose ranks a launcher started (`parallel/launched.py`): what global rank 0 keeps and the others are handed.

Every rank loads the data, measures the job's links with the others, trains and refits; global rank 0 alone owns the
run folder (it creates, locks and renames it; the others write only their `ranks/` activity files into it), decides
the pre-flight from the measured links, evaluates, maps and writes the reports. On several nodes the folder
(output.root, and `resume=`) must be on a file system every node sees: the README's "Several nodes" says so, and
rank 0's node has everything a run keeps if it is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from hslite.parallel.plan import Plan
from hslite.parallel.ranks.launched import LaunchedJob
from hslite.preflight_check.hardware.job_links import job_mesh, measure_job_topology
from hslite.preflight_check.hardware.topology import Topology
from hslite.preflight_check.measure.loop_cost import measure_step_overhead
from hslite.run.folder import RunFolder
from hslite.task import HSIClassifier


@dataclass
class FolderView:
    """Rank 0's run folder as another launched rank sees it: where it is, nothing to create or rename."""

    path: Path
    resumptions: list[dict[str, str]] = field(default_factory=list)


@contextmanager
def run_folder(parent: Path, resume: Path | None, job: LaunchedJob | None) -> Iterator[RunFolder | FolderView]:
    """The run's folder: a RunFolder on one box and on rank 0 of a launched job; a FolderView of it on the others."""
    if job is None:
        with RunFolder(parent, resume=resume) as run:
            yield run
    elif job.leader:
        with RunFolder(parent, resume=resume) as run:
            job.from_leader(lambda: run.path)
            yield run
    else:
        yield FolderView(job.from_leader(lambda: parent))  # the lambda runs on rank 0 only: this is rank 0's path


def measured_links(
    job: LaunchedJob, plan: Plan, max_cross_node_ratio: float, num_classes: int
) -> tuple[Topology, dict[str, Any]]:
    """The job's links and loop measured on its ranks (every rank calls this), and what preflight.json records.

    The record: each link's figures, R against its threshold, the loop's cost per micro-step with the job's ranks,
    and the mesh the plan builds on the launcher's nodes.
    """
    import torch

    placement = job.placement()
    node_of_rank = [node for node, _ in placement]
    device = torch.device("cuda", torch.cuda.current_device()) if plan.accelerator == "gpu" else torch.device("cpu")
    topology = measure_job_topology(node_of_rank, device, max_cross_node_ratio)
    loop_plan = Plan(devices=plan.devices, num_nodes=plan.num_nodes, accelerator=plan.accelerator)
    topology = replace(topology, job_loop_seconds=measure_step_overhead(loop_plan, num_classes, launched=True))
    hosts = sorted({host for _, host in placement})
    record: dict[str, Any] = {
        "links": {name: getattr(topology, name) for name in topology.source},
        "links_source": topology.source,
        "bandwidth_ratio": None if math.isinf(topology.bandwidth_ratio) else topology.bandwidth_ratio,
        "max_cross_node_ratio": max_cross_node_ratio,
        "loop_seconds": topology.job_loop_seconds,
        "mesh": {**job_mesh(plan, node_of_rank), "hosts": hosts},
    }
    if len(hosts) < topology.nodes:  # two torchrun agents on one machine, as the tests and the README's demo start
        record["links_note"] = (
            f"the job's {topology.nodes} nodes run on {len(hosts)} host(s) ({', '.join(hosts)}): the link measured "
            "across nodes is a host's own, not a network's, and unless each node's agent is pinned to cores of its "
            "own (taskset) their ranks share them"
        )
    return topology, record


def whole_task(
    trainer: pl.Trainer, task: HSIClassifier, job: LaunchedJob | None, plan: Plan, fresh: Callable[[], HSIClassifier]
) -> HSIClassifier:
    """The trained model as rank 0 evaluates it alone (a collective on every launched rank; one box: `task`).

    Spawned ranks hand rank 0's weights back to a process that never trained (`fsdp._FullStateLauncher` gathers
    shards). Launched ranks trained in this process: under plain (or int8) DDP the module is whole and DDP's hooks sit
    on its wrapper, so it is evaluated as it is. FSDP's module holds shards, a channel-group forward exchanges tokens
    with the other ranks, and rotation leaves a subset of groups active: rank 0 then evaluates a `fresh` model
    holding the strategy's whole state dict (shards and channel-group replicas gathered).
    """
    if job is None or not (plan.fsdp or plan.chag_enabled or plan.rotation_enabled):
        return task
    state: dict[str, Any] = trainer.strategy.lightning_module_state_dict()  # whole on rank 0
    if not job.leader:
        return task
    whole = fresh()
    whole.load_state_dict(state)
    return whole
