"""Communication of one optimiser step of a Plan: what is exposed, what channel groups exchange, and its regime.

DDP's gradient all-reduce (overlapping backward but for its last bucket, and not at all under a synchronous hook),
FSDP's gathers and reduce-scatters per unit, and the channel groups' token all-to-all (DESIGN §3), from the ring
formulas of `formulas.py`. Shared by `costmodel.predict` and the what-if pricing of absent devices. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from hslite.preflight.formulas import (
    allgather_seconds,
    allreduce_seconds,
    alltoall_seconds,
    reduce_scatter_seconds,
    wire_bytes,
)
from hslite.preflight.regime import plan_regime

if TYPE_CHECKING:
    from hslite.parallel.plan import Plan
    from hslite.preflight.measurements import Footprint, LinkModel

# torch DDP's default bucket_cap_mb=25: the last bucket to fill is reduced after backward, so it never overlaps.
DDP_BUCKET_CAP_BYTES = 25 * 2**20
# Compressions whose DDP hook runs its collectives inside the hook and returns a completed future (compression.py's
# int8 hook: a second collective waited on in a `.then` callback deadlocks over gloo). Backward resumes only once a
# bucket's exchange is done, so none of it hides under backward (DESIGN §3, DDP overlap).
SYNCHRONOUS_HOOKS = frozenset({"int8"})


def comm_seconds(
    plan: Plan,
    sizes: Footprint,
    link: LinkModel,
    chag_link: LinkModel | None,
    backward_seconds: float,
    exact: bool,
    notes: list[str],
) -> float:
    """Communication per optimiser step not hidden under `backward_seconds` (0 gives the no-overlap bound)."""
    exposed_seconds = 0.0
    if plan.dp > 1 and plan.fsdp:  # all-gather params in forward and backward, reduce-scatter grads (§3)
        # Every micro-step: FSDP2 frees the gathered units after use and reduce-scatters each backward's gradients
        # (Lightning does not skip the gradient sync of FSDP2 between accumulated micro-batches).
        per_micro_step = 2 * allgather_seconds(sizes.param_bytes, plan.dp, link, ring_factor_exact=exact)
        per_micro_step += reduce_scatter_seconds(sizes.grad_bytes, plan.dp, link, ring_factor_exact=exact)
        # Each unit gathers twice and reduce-scatters once on its own: the latency is paid per unit
        per_micro_step += 3 * ((sizes.fsdp_units or 1) - 1) * (plan.dp - 1) * link.alpha_seconds
        exposed_seconds = max(0.0, plan.accumulate * per_micro_step - link.overlap * backward_seconds)
    elif plan.world_size > 1:  # DDP spans every rank: channel-group ranks hold shares of one gradient
        seconds = allreduce_seconds(
            wire_bytes(sizes.grad_bytes, plan.compression), plan.world_size, link, ring_factor_exact=exact
        )
        overlap = link.overlap * max(0.0, 1.0 - DDP_BUCKET_CAP_BYTES / max(sizes.grad_bytes, 1))
        if plan.compression in SYNCHRONOUS_HOOKS:
            overlap = 0.0
            if link.overlap > 0:
                notes.append(f"{plan.compression}'s hook exchanges each bucket before backward goes on: no overlap")
        exposed_seconds = max(0.0, seconds - overlap * backward_seconds)
        if plan.compression in ("bf16", "fp16"):
            notes.append(f"{plan.compression} cast cost not priced")
    if plan.chag_enabled:
        exposed_seconds += _chag_seconds(plan, sizes, chag_link or link, exact, notes)
    return exposed_seconds


def chag_token_bytes(plan: Plan, probe: Footprint) -> int:
    """Bytes one token exchange writes on a rank per micro-step: b/chag × G × L × D, × k/G under rotation.

    Forward, its slice of the samples' tokens of every group; backward, its groups' gradient for all b samples:
    the same size (channel_groups.py). 0 without chag.
    """
    if not plan.chag_enabled or probe.group_token_bytes_per_sample is None:
        return 0
    active = plan.rotation_groups / probe.band_groups if plan.rotation_enabled and probe.band_groups else 1.0
    return round(probe.group_token_bytes_per_sample * plan.batch_size * active / plan.chag)


def _chag_seconds(plan: Plan, probe: Footprint, link: LinkModel, exact: bool, notes: list[str]) -> float:
    # The all-to-all of the group tokens forward and of their gradient backward, per micro-step.
    if probe.group_token_bytes_per_sample is None:
        notes.append("channel-group traffic not priced: the probe did not measure the group token size")
        return 0.0
    token_bytes = chag_token_bytes(plan, probe)
    return plan.accumulate * 2 * alltoall_seconds(token_bytes, plan.chag, link, ring_factor_exact=exact)


def comm_regime(
    plan: Plan,
    probe: Footprint,
    link: LinkModel,
    chag_link: LinkModel | None,
    exact: bool,
    exposed_seconds: float,
    compute_seconds: float,
) -> str:
    """The plan's regime (`regime.plan_regime`) from its communication split into latency and bytes (none hidden)."""

    def latency_only(model: LinkModel) -> LinkModel:
        return replace(model, bandwidth_bytes_per_second=math.inf)

    latency = comm_seconds(plan, probe, latency_only(link), chag_link and latency_only(chag_link), 0.0, exact, [])
    wire = comm_seconds(plan, probe, link, chag_link, 0.0, exact, []) - latency
    return plan_regime(exposed_seconds, latency, wire, compute_seconds)
