"""Communication of one optimiser step of a Plan: what is exposed, what channel groups exchange, and its regime.

DDP's gradient all-reduce (overlapping backward but for its last bucket, and not at all under a synchronous hook),
FSDP's gathers and reduce-scatters per unit, and the channel groups' token all-to-all (docs/design.md), from the ring
formulas of `formulas.py`. Shared by `costmodel.predict` and the what-if pricing of absent devices. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from hslite.parallel.channels.group_owners import rank_groups
from hslite.parallel.wire_format import DEFAULT_CHUNK_ELEMS, compressed_bytes, fsdp_wire_bytes, shard_layout
from hslite.preflight_check.price.formulas import (
    allgather_seconds,
    allreduce_seconds,
    alltoall_seconds,
    reduce_scatter_seconds,
)
from hslite.preflight_check.price.regime import plan_regime

if TYPE_CHECKING:
    from hslite.parallel.plan import Plan
    from hslite.preflight_check.measurements import Footprint, LinkModel

# torch DDP's default bucket_cap_mb=25: the last bucket to fill is reduced after backward, so it never overlaps.
DDP_BUCKET_CAP_BYTES = 25 * 2**20
FP32_BYTES = 4  # the int8 hook works on the bucket in fp32 whatever the gradient dtype
# Compressions whose DDP hook runs its collectives inside the hook and returns a completed future (compression.py's
# int8 hook: a second collective waited on in a `.then` callback deadlocks over gloo). Backward resumes only once a
# bucket's exchange is done, so none of it hides under backward (docs/design.md, DDP overlap).
SYNCHRONOUS_HOOKS = frozenset({"int8"})
# Kernels compression.py's int8 hook launches per bucket whatever the world size N, with error feedback: the residual
# added (1); the bucket quantised (abs, amax, ÷127, clamp, ÷, round: 6) and packed with its scales (2); the residual
# kept (1); the all-to-all (1); the scales received made contiguous (1); the mean zeroed (1), divided by N (1),
# re-quantised (6) and packed (2); its error kept, added to the own shard and cleared of NaNs (3); the all-gather (1);
# its scales made contiguous (1). Per peer, twice: a received shard added into the mean, an owner's shard dequantised
# into the bucket. A padded bucket also zeroes its padding and copies its last shard out (2).
INT8_KERNELS_PER_BUCKET = 27
INT8_KERNELS_PER_PEER = 2
INT8_KERNELS_IF_PADDED = 2


def comm_seconds(
    plan: Plan,
    sizes: Footprint,
    link: LinkModel,
    node_link: LinkModel | None,
    backward_seconds: float,
    exact: bool,
    notes: list[str],
) -> float:
    """Communication per optimiser step not hidden under `backward_seconds` (0 gives the no-overlap bound).

    `link`: the data-parallel ring (every rank; FSDP's shard group unless hybrid). `node_link`: the link inside a
    node, for channel groups' token exchange and a hybrid shard group's gathers (None: `link`).
    """
    exposed_seconds = 0.0
    if plan.dp > 1 and plan.fsdp:  # all-gather params in forward and backward, reduce-scatter grads (docs/design.md)
        # Every micro-step: FSDP2 frees the gathered units after use and reduce-scatters each backward's gradients
        # (Lightning does not skip the gradient sync of FSDP2 between accumulated micro-batches). Hybrid sharding
        # does that inside a node, then all-reduces each unit's gradient shard across the nodes' replicas.
        shards, shard_link, units = (
            plan.shard_ranks,
            (node_link or link) if plan.hybrid_shard else link,
            sizes.fsdp_units or 1,
        )
        per_micro_step = 2 * allgather_seconds(sizes.param_bytes, shards, shard_link, ring_factor_exact=exact)
        per_micro_step += reduce_scatter_seconds(sizes.grad_bytes, shards, shard_link, ring_factor_exact=exact)
        # Each unit gathers twice and reduce-scatters once on its own: the latency is paid per unit
        per_micro_step += 3 * (units - 1) * (shards - 1) * shard_link.alpha_seconds
        if plan.hybrid_shard and plan.num_nodes > 1:
            replicas = plan.num_nodes
            per_micro_step += allreduce_seconds(sizes.grad_bytes / shards, replicas, link, ring_factor_exact=exact)
            per_micro_step += 2 * (units - 1) * (replicas - 1) * link.alpha_seconds
        exposed_seconds = max(0.0, plan.accumulate * per_micro_step - shard_link.overlap * backward_seconds)
    elif plan.world_size > 1:  # DDP spans every rank; band groups' own gradients are summed over their owners
        ddp_bytes, owned_bytes = gradient_split(plan, sizes)
        seconds = allreduce_seconds(
            compressed_bytes(ddp_bytes, plan.compression), plan.world_size, link, ring_factor_exact=exact
        )
        overlap = link.overlap * max(0.0, 1.0 - DDP_BUCKET_CAP_BYTES / max(ddp_bytes, 1))
        if plan.compression in SYNCHRONOUS_HOOKS:
            overlap = 0.0
            if link.overlap > 0:
                notes.append(f"{plan.compression}'s hook exchanges each bucket before backward goes on: no overlap")
        exposed_seconds = max(0.0, seconds - overlap * backward_seconds)
        if owned_bytes:  # after backward, in fp32 whatever the compression (group_gradients.py)
            exposed_seconds += allreduce_seconds(owned_bytes, plan.dp, link, ring_factor_exact=exact)
        if plan.compression in ("bf16", "fp16"):
            notes.append(f"{plan.compression} cast cost not priced")
    if plan.chag_enabled:
        exposed_seconds += _chag_seconds(plan, sizes, node_link or link, exact, notes)
    return exposed_seconds


def int8_kernels_per_bucket(elements: int, world_size: int) -> int:
    """Kernels the int8 hook launches to all-reduce a bucket of `elements` fp32 gradients over `world_size` ranks."""
    shard, _, _ = shard_layout(elements, world_size, DEFAULT_CHUNK_ELEMS)
    padded = world_size * shard > elements
    return INT8_KERNELS_PER_BUCKET + INT8_KERNELS_PER_PEER * world_size + (INT8_KERNELS_IF_PADDED if padded else 0)


def int8_hook_seconds(grad_bytes: float, world_size: int, work_seconds_per_byte: float, launch_seconds: float) -> float:
    """The int8 hook's own seconds per optimiser step: its kernels' work on the gradient, and their launches per bucket.

    The work grows with the gradient, not with the ranks: every peer's piece is a shard of the bucket. The launches
    grow with both, `int8_kernels_per_bucket` per DDP bucket (full buckets of DDP_BUCKET_CAP_BYTES and the rest; DDP
    never splits a parameter, so real buckets differ a little) at `launch_seconds` each, the host's time to issue
    one: on a GPU a bucket of a small model costs more in launches than in work. The hook runs inside backward and
    returns a completed future, so neither hides (docs/design.md, compressed all-reduce).
    """
    full, rest = divmod(int(grad_bytes), DDP_BUCKET_CAP_BYTES)
    buckets = [DDP_BUCKET_CAP_BYTES] * full + ([rest] if rest else [])
    kernels = sum(int8_kernels_per_bucket(size // FP32_BYTES, world_size) for size in buckets)
    return work_seconds_per_byte * grad_bytes + kernels * launch_seconds


def gradient_split(plan: Plan, sizes: Footprint) -> tuple[float, float]:
    """Gradient bytes per step: (DDP's, over every rank; the most loaded rank's band groups' own, over its dp peers).

    Under channel groups a band group's own gradients are summed over the dp peers of the rank that owns it
    (group_gradients.py): none to send at dp = 1, and only the step's active groups under rotation.
    """
    if not plan.chag_enabled or not sizes.group_grad_bytes or not sizes.band_group_sizes:
        return float(sizes.grad_bytes), 0.0
    owners = rank_groups(sizes.band_group_sizes, plan.chag)
    owned = max(sum(sizes.group_grad_bytes[g] for g in groups) for groups in owners)
    active = plan.rotation_groups / len(owners) / len(owners[0]) if plan.rotation_enabled else 1.0
    return float(sizes.grad_bytes - sum(sizes.group_grad_bytes)), owned * active if plan.dp > 1 else 0.0


def grad_bytes_per_step(plan: Plan, sizes: Footprint) -> float:
    """Bytes one rank sends per optimiser step in gradient collectives (ring formulas): what usage.py measures.

    DDP: 2(N − 1)/N of its wire bytes, and 2(dp − 1)/dp of the band groups' own under channel groups. FSDP: per
    micro-step, (N − 1)/N of the parameters gathered twice (in the compute dtype) and of the fp32 gradients, over
    the S ranks of a shard group; hybrid sharding adds the all-reduce of a 1/S gradient shard over the R replicas.
    """
    if plan.world_size == 1:
        return 0.0
    if plan.fsdp:
        gathered = sizes.param_count * (2 if plan.precision == "bf16-mixed" else 4)  # fsdp_policy's param_dtype
        replicas = plan.dp // plan.shard_ranks
        return plan.accumulate * fsdp_wire_bytes(gathered, sizes.grad_bytes, plan.shard_ranks, replicas)
    ddp_bytes, owned_bytes = gradient_split(plan, sizes)
    ring = 2 * (plan.world_size - 1) / plan.world_size * compressed_bytes(ddp_bytes, plan.compression)
    return ring + (2 * (plan.dp - 1) / plan.dp * owned_bytes if plan.dp > 1 else 0.0)


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
    node_link: LinkModel | None,
    exact: bool,
    exposed_seconds: float,
    compute_seconds: float,
) -> str:
    """The plan's regime (`regime.plan_regime`) from its communication split into latency and bytes (none hidden)."""

    def latency_only(model: LinkModel) -> LinkModel:
        return replace(model, bandwidth_bytes_per_second=math.inf)

    latency = comm_seconds(plan, probe, latency_only(link), node_link and latency_only(node_link), 0.0, exact, [])
    wire = comm_seconds(plan, probe, link, node_link, 0.0, exact, []) - latency
    return plan_regime(exposed_seconds, latency, wire, compute_seconds)
