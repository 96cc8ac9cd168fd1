"""The links of a launched job measured on its own ranks, and the mesh its plan builds on them.

A plan across nodes is priced on two links (docs/design.md, mapping): the one inside a node, where channel groups stay,
and the one data parallelism crosses. When a launcher has started the job both are here, so the pre-flight
measures them rather than assume a profile, hierarchically: first every node's ranks at once, each node over a
group of its own (the link channel groups use), then every rank together (the gradient all-reduce's own ring, whose
slowest hop is the link between nodes). Each node's figure is gathered and the slowest node's kept. Nodes are read
from the launcher (`node_rank`), not from rank order, so a scheduler that numbers ranks round-robin is seen as such.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from hslite.parallel.plan import Plan
from hslite.preflight_check.hardware.links import measure_launched_link
from hslite.preflight_check.hardware.topology import PER_LAYER_CROSS_NODE_MAX_RATIO, Topology
from hslite.preflight_check.measurements import LinkModel


def job_mesh(plan: Plan, node_of_rank: list[int]) -> dict[str, Any]:
    """Which ranks each node holds, and the plan's channel groups and data-parallel groups on them.

    Channel groups are `chag` consecutive global ranks (`channel_groups.py`'s row-major (dp, chag) mesh).
    """
    world = len(node_of_rank)
    chag = max(plan.chag, 1)
    chag_groups = [list(range(start, start + chag)) for start in range(0, world, chag)]
    return {
        "nodes": [[r for r in range(world) if node_of_rank[r] == n] for n in sorted(set(node_of_rank))],
        "chag_groups": chag_groups if chag > 1 else [],
        "dp_groups": [list(range(c, world, chag)) for c in range(chag)],
        "chag_inside_nodes": all(len({node_of_rank[r] for r in group}) == 1 for group in chag_groups),
    }


def measure_job_topology(
    node_of_rank: list[int],
    device: torch.device,
    max_cross_node_ratio: float = PER_LAYER_CROSS_NODE_MAX_RATIO,
    repeats: int = 5,
) -> Topology:
    """The job's links as a Topology the pre-flight prices from; every rank of the job calls this, in step.

    `node_of_rank[r]` is the node of global rank r (the same list on every rank). Device memory is the least any
    rank has free (host memory on CPU ranks). Without several ranks per node there is no intra-node link (None, as
    in a profile of one-GPU nodes); a job on one node has no inter-node link.
    """
    world, me = len(node_of_rank), dist.get_rank()
    nodes = sorted(set(node_of_rank))
    per_node = world // len(nodes)
    intra: LinkModel | None = None
    if per_node > 1:
        groups = [
            dist.new_group([r for r in range(world) if node_of_rank[r] == n]) for n in nodes
        ]  # all ranks, in order
        mine = measure_launched_link(groups[nodes.index(node_of_rank[me])], per_node, device, repeats)
        intra = _slowest(mine, device)
    across = measure_launched_link(None, world, device, repeats) if len(nodes) > 1 else None
    source = f"measured on this job's ranks ({len(nodes)} node(s) × {per_node})"
    return Topology(
        name="measured on this job's ranks",
        nodes=len(nodes),
        gpus_per_node=per_node,
        intra_gbps=None if intra is None else intra.bandwidth_bytes_per_second / 1e9,
        inter_gbps=None if across is None else across.bandwidth_bytes_per_second / 1e9,
        intra_latency_us=None if intra is None else intra.alpha_seconds * 1e6,
        inter_latency_us=None if across is None else across.alpha_seconds * 1e6,
        device_memory_gib=_least_memory_bytes(device) / 2**30,
        source={
            "intra_gbps": f"{source}: each node's ranks at once, the slowest node's",
            "inter_gbps": f"{source}: every rank's all-reduce, the ring data parallelism runs on",
            "intra_latency_us": f"{source}, fitted with the bandwidth",
            "inter_latency_us": f"{source}, fitted with the bandwidth",
            "device_memory_gib": "the least free device memory of any rank (host memory for CPU ranks)",
        },
        overlap=(across or intra or LinkModel.no_cost()).overlap,
        max_cross_node_ratio=max_cross_node_ratio,
        measured=True,
    )


def _slowest(link: LinkModel, device: torch.device) -> LinkModel:
    """The slowest node's link, on every rank: the highest latency and the lowest bandwidth any node measured."""
    figures = torch.tensor(
        [link.alpha_seconds, -link.bandwidth_bytes_per_second, -link.overlap], dtype=torch.float64, device=device
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    alpha, bandwidth, overlap = float(figures[0]), -float(figures[1]), -float(figures[2])
    return LinkModel(alpha, bandwidth if math.isfinite(bandwidth) else math.inf, overlap, link.source, link.points)


def _least_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    least = torch.tensor([free], dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least.item())
