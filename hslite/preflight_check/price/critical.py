"""P* per link, shown to the user: the model size where data parallelism starts (or stops) paying on each link.

For the requested per-device batch and this model's compute (c0 + c1·b from the probe, measured here or priced from
a device profile, slowed by s where this box's CPU ranks share cores), P* is where the ring all-reduce's
r = T_comm / T_c crosses r* = 1/(s·E_min) − 1, the ratio at which E = 1/(s·(1 + r)) meets
`preflight.min_efficiency` (docs/design.md: T_c ≈ c0 + c1·P·b, the design's assumption that compute grows with the
parameters). One row per link: this box's (measured) or the requested topology's, and each bundled topology's at
the same rank count with a device per rank (s = 1), so a team sees which links its model size needs.

The training loop's own cost (`measure/loop_cost.py`) enters as the plans are priced: one rank's, L1, is part
of the fixed compute (c0 + L1), and what the plan's N ranks add to it beyond s·L1 part of the latency term (alpha +
L_N − s·L1), so P* prices the step the plan table prices. E here is against one device at the same micro-batch
(r ≤ r*, docs/design.md); the plan table's E is against the best one-device plan (a bigger batch, AMP), so a small model
can "pay" here at E 0.7 beside a plan priced at E 0.43 there. DDP's overlap does not enter P*.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.preflight_check.hardware.topology import Topology, list_topologies, load_topology
from hslite.preflight_check.measurements import LinkModel, ProbeResult
from hslite.preflight_check.price.costmodel import Prediction
from hslite.preflight_check.price.formulas import critical_params, ring_allreduce_terms

_SIDE = {"above": "models of P* and up", "below": "models up to P*", "always": "every size", "never": "no size"}


def bundled_links(world_size: int) -> dict[str, LinkModel]:
    """The link a ring of `world_size` ranks uses on each bundled topology that has that many GPUs, by name."""
    links: dict[str, LinkModel] = {}
    for name in list_topologies():
        topology = load_topology(name)
        nodes = -(-world_size // topology.gpus_per_node)
        if nodes > topology.nodes or world_size % nodes:
            continue
        where = "inside a node" if nodes == 1 else f"across {nodes} nodes"
        try:
            link = topology.link_for(Plan(devices=world_size // nodes, num_nodes=nodes, accelerator="gpu"))
        except ConfigError:  # the profile has no link of that kind
            continue
        if all((link.alpha_seconds, link.bandwidth_bytes_per_second) != (seen.alpha_seconds,
               seen.bandwidth_bytes_per_second) for seen in links.values()):  # fmt: skip
            links[f"{name} ({where})"] = link  # the nodes of a two-node profile are another's one node
    return links


def critical_params_report(
    probe: ProbeResult,
    batch_size: int,
    world_size: int,
    links: dict[str, tuple[LinkModel, float, float]],
    min_efficiency: float,
    alone_loop_seconds: float = 0.0,
) -> dict[str, Any]:
    """P* of `probe`'s model on each of `links` at `world_size` ranks of `batch_size`, with the model's own P.

    Each link comes with s, how much slower a rank computes beside the others there (CPU ranks sharing cores; 1
    where each rank has a device of its own), and the seconds per step the loop of its N ranks costs beyond s × one
    rank's (`alone_loop_seconds`; module notes).
    """
    c0 = probe.compute_c0_seconds + alone_loop_seconds
    c1 = probe.compute_c1_seconds_per_sample / probe.param_count
    grad_element_bytes = probe.grad_bytes / probe.param_count
    rows = []
    for name, (link, slowdown, added_loop) in links.items():
        r_target = 1 / (slowdown * min_efficiency) - 1
        alpha, beta = ring_allreduce_terms(link, world_size, grad_element_bytes)
        p_star = critical_params(slowdown * c0, slowdown * c1, batch_size, alpha + added_loop, beta, r_target=r_target)
        rows.append({"link": name, "p_star": p_star.params, "pays": p_star.pays, "pays_for": _SIDE[p_star.pays],
                     "pays_for_this_model": p_star.pays_at(probe.param_count), "r_target": r_target,
                     "slowdown": slowdown, "alpha_seconds": link.alpha_seconds,
                     "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second,
                     "added_loop_seconds": added_loop})  # fmt: skip
    return {
        "model_params": probe.param_count,
        "world_size": world_size,
        "batch_size": batch_size,
        "c0_seconds": probe.compute_c0_seconds,
        "c1_seconds_per_param_sample": c1,
        "loop_seconds": alone_loop_seconds,
        "links": rows,
    }


def critical_params_of_verdict(
    requested: Plan,
    predictions: dict[Plan, Prediction],
    plan_links: dict[Plan, LinkModel],
    probe: ProbeResult,
    topology: Topology | None,
    min_efficiency: float,
    loop_seconds: Callable[[Plan], float] = lambda plan: 0.0,
) -> dict[str, Any]:
    """P* on the link the requested DP uses and on each bundled topology's, at the same rank count.

    For a one-device request, the link of plain DP over 2 of this box's devices, when that plan was priced.
    `loop_seconds(plan)` is the loop's cost per micro-step the plans were priced with. Bundled topologies' GPUs are
    not here: their ranks' loop is priced as one local rank's, as a plan on them is, so it adds nothing beyond L1.
    """
    world = max(requested.world_size, 2)
    plain = [p for p in predictions if p.world_size == p.dp == world and p.num_nodes == requested.num_nodes
             and not (p.fsdp or p.compression_enabled)]  # fmt: skip
    dp_plan = requested if requested.world_size > 1 else next(iter(plain), None)
    alone_loop = loop_seconds(Plan(accelerator=requested.accelerator))
    p_star_links = {name: (link, 1.0, 0.0) for name, link in bundled_links(world).items()}
    if dp_plan is not None:
        here = f"topology {topology.name}" if topology is not None else f"this box ({world} ranks, measured)"
        slowdown = predictions[dp_plan].oversubscription
        mine = (plan_links[dp_plan], slowdown, loop_seconds(dp_plan) - slowdown * alone_loop)
        p_star_links = {here + (", as requested" if dp_plan == requested else ""): mine, **p_star_links}
    batch = dp_plan.batch_size if dp_plan is not None else requested.batch_size
    return critical_params_report(probe, batch, world, p_star_links, min_efficiency, alone_loop)
