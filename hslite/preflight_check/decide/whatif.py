"""What-if pricing of devices that are not here: links and memory only, never this machine's compute (docs/design.md).

A GPU plan priced on a CPU box cannot be timed: ranking it or deciding GO/NO-GO from CPU step times would be a
guess wearing a number. So only what the model's own sizes and the link profile determine is priced, and the
verdict says plainly that compute was not measured: NO-GO (exit 3) when the plan cannot fit, otherwise UNDECIDED
(exit 4), with the link time and memory of each candidate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hslite.preflight_check.decide.verdict import Verdict, gib
from hslite.preflight_check.price.comm_cost import chag_token_bytes, comm_seconds, grad_bytes_per_step
from hslite.preflight_check.price.costmodel import memory_breakdown_bytes, memory_budget_bytes

if TYPE_CHECKING:
    from hslite.parallel.plan import Plan
    from hslite.preflight_check.measurements import Footprint, LinkModel


@dataclass
class FootprintPrediction:
    """What a plan costs that does not depend on compute: seconds on its links and memory per device.

    For devices that are not here (docs/design.md, what-if pricing): their compute is not measured, so there is no step
    time, throughput or efficiency, only what the model's own sizes and the link profile determine.
    """

    comm_seconds: float  # per optimiser step on the plan's links, none of it hidden (no backward time to hide under)
    grad_bytes_per_step: float  # one rank's gradient collectives, ring formulas (comm_cost.grad_bytes_per_step)
    chag_bytes_per_step: int  # group tokens and their gradients a rank's exchanges write per step (costmodel)
    per_device_peak_bytes: int
    fits_memory: bool
    memory_budget_bytes: int
    memory_breakdown_bytes: dict[str, int] = field(default_factory=dict)
    mapping_refusal: str | None = None  # `Topology.mapping_refusal`: a layout that is refused whatever its speed
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for preflight JSON."""
        return asdict(self)


def predict_footprint(
    plan: Plan,
    sizes: Footprint,
    link: LinkModel,
    device_memory_bytes: int,
    *,
    node_link: LinkModel | None = None,
) -> FootprintPrediction:
    """Price the compute-free parts of one plan: link seconds (no-overlap bound) and per-device memory."""
    notes: list[str] = []
    link_seconds = comm_seconds(plan, sizes, link, node_link, 0.0, True, notes)
    if plan.world_size > 1 and plan.compression == "int8":
        notes.append("int8 quantise cost is compute: not priced")
    breakdown = memory_breakdown_bytes(plan, sizes)
    peak_bytes = sum(breakdown.values())
    budget_bytes = memory_budget_bytes(plan, device_memory_bytes)
    return FootprintPrediction(
        comm_seconds=link_seconds,
        grad_bytes_per_step=grad_bytes_per_step(plan, sizes),
        chag_bytes_per_step=2 * plan.accumulate * chag_token_bytes(plan, sizes),
        per_device_peak_bytes=peak_bytes,
        fits_memory=peak_bytes <= budget_bytes,
        memory_budget_bytes=budget_bytes,
        memory_breakdown_bytes=breakdown,
        notes=notes,
    )


def decide_without_compute(
    requested: Plan, predictions: dict[Plan, FootprintPrediction], why_unmeasured: str
) -> Verdict:
    """NO-GO when the requested plan cannot fit in device memory, otherwise UNDECIDED; never ranked by speed."""
    rows = [
        {
            "plan": plan.describe(),
            "comm_seconds": pred.comm_seconds,
            "grad_bytes_per_step": pred.grad_bytes_per_step,
            "per_device_peak_bytes": pred.per_device_peak_bytes,
            "memory_budget_bytes": pred.memory_budget_bytes,
            "fits": pred.fits_memory,
            "requested": plan == requested,
            "notes": pred.notes,
        }
        for plan, pred in predictions.items()
    ]
    # Not a ranking (nothing here says which is faster): the request, then the layouts with most devices first.
    world = {plan.describe(): plan.world_size for plan in predictions}
    rows.sort(key=lambda row: (not row["requested"], -world[str(row["plan"])]))
    pred = predictions[requested]
    reasons = [
        f"compute not measured: {why_unmeasured}. No step time, throughput, efficiency or ranking is given; "
        "run `hslite preflight` on the machine itself to decide"
    ]
    if pred.fits_memory:
        reasons.append(
            f"{requested.describe()} fits: {gib(pred.per_device_peak_bytes)} of {gib(pred.memory_budget_bytes)} "
            f"per device (parameters, gradients, optimiser state and activations counted from the model itself)"
        )
    else:
        reasons.append(
            f"{requested.describe()} needs {gib(pred.per_device_peak_bytes)} per device but the profile's device "
            f"has {gib(pred.memory_budget_bytes)}: it cannot run there whatever its speed"
        )
    if requested.world_size > 1:
        moved = [f"each rank's gradient collectives send {pred.grad_bytes_per_step / 2**20:.3g} MiB"]
        if requested.chag_enabled:
            moved.append(f"its channel groups exchange {pred.chag_bytes_per_step / 2**20:.3g} MiB of group tokens")
        reasons.append(
            f"{' and '.join(moved)} per step: {pred.comm_seconds * 1e3:.3g} ms on the profile's links with none of "
            "it hidden under backward"
        )
    if pred.mapping_refusal:
        reasons.append(pred.mapping_refusal)
    go = None if pred.fits_memory and not pred.mapping_refusal else False
    return Verdict(go, requested, None, 0.0, reasons, None, None, predictions, rows, compute_measured=False)
