"""Predicted step time and memory of a Plan, from one device's probe and a link model (docs/design.md).

`predict` composes the analytic formulas of `formulas.py` with the probe's measured times and sizes, part by part:
compute (`_compute_seconds`, slowed by `_cpu_sharing`), communication (`comm_seconds`, `_quantise_seconds`), the
training loop, and memory (`memory_breakdown_bytes` against `memory_budget_bytes`). Memory and communication are
shared with the what-if pricing of absent devices (`whatif.py`). Torch-free.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hslite.parallel.channels.group_owners import rank_groups
from hslite.preflight_check.hardware.device_profile import launch_seconds_on
from hslite.preflight_check.price.comm_cost import (
    chag_token_bytes,
    comm_regime,
    comm_seconds,
    grad_bytes_per_step,
    gradient_split,
    int8_hook_seconds,
)
from hslite.preflight_check.price.tail import tail_factor, tail_note

if TYPE_CHECKING:
    from hslite.parallel.plan import Plan
    from hslite.preflight_check.measurements import Footprint, LinkModel, ProbeResult

# Quantise + dequantise (with error feedback) kernel work per fp32 gradient byte when the probe did not measure it;
# the launches are priced apart (comm_cost.int8_hook_seconds). cpu: the order of what the probe's
# measure_compression times with one thread on an 8 MB buffer (it measures this box's figure whenever a plan
# compresses). gpu: an estimate, ~8 passes over the buffer at ~2 TB/s of HBM; measure it when it matters.
DEFAULT_COMPRESS_SECONDS_PER_BYTE = {"cpu": 3e-9, "gpu": 1e-11}


@dataclass
class Prediction:
    """What one plan is predicted to cost, per optimiser step, and whether it fits."""

    step_seconds: float  # one optimiser step (G micro-steps)
    compute_seconds: float
    loop_seconds: float  # the training loop's own cost (Lightning, metrics, DDP bookkeeping) over the G micro-steps
    comm_seconds: float  # exposed (not hidden under backward)
    samples_per_second: float  # global
    ecd: float  # effective compute per device: global samples/s ÷ world size
    per_device_peak_bytes: int
    fits_memory: bool
    speedup: float  # S(N) against the same per-device plan alone on one device
    chag_bytes_per_step: int  # group tokens and their gradients one rank's exchanges write (chag_token_bytes × 2)
    grad_bytes_per_step: float  # one rank's gradient collectives, ring formulas (comm_cost.grad_bytes_per_step)
    r: float  # communication/computation ratio, S(N) = N/(1+r)
    memory_budget_bytes: int  # what one rank may use (host memory ÷ processes on CPU)
    memory_breakdown_bytes: dict[str, int] = field(default_factory=dict)
    regime: str = "compute-bound"  # compute-, latency- or communication-bound (`regime.plan_regime`)
    oversubscription: float = 1.0  # CPU compute slow-down from ranks sharing cores, caches, memory; 1: none
    cpu_cores: int | None = None  # cores the CPU ranks share; None on GPU
    # why the layout breaks the topology's mapping rule (`Topology.mapping_refusal`): it never passes
    mapping_refusal: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for preflight.json."""
        return asdict(self)


def memory_breakdown_bytes(plan: Plan, probe: Footprint) -> dict[str, int]:
    """Per-rank peak terms (docs/design.md, memory): params, grads, optimiser (÷ dp, FSDP), activations, workspace."""
    shards = plan.shard_ranks if plan.fsdp else 1
    activation_factor = _tokenizer_factor(plan, probe, probe.tokenizer_activation_fraction, plan.chag, worst=True)
    counted = probe.param_bytes + probe.grad_bytes + probe.optimizer_bytes + probe.activation_bytes
    breakdown = {
        "params": math.ceil(probe.param_bytes / shards),
        "grads": math.ceil(probe.grad_bytes / shards),
        "optimizer": math.ceil(probe.optimizer_bytes / shards),
        "activations": math.ceil(probe.activation_bytes * plan.batch_size / probe.batch_size * activation_factor),
        "workspace": max(0, probe.peak_bytes - counted),  # allocator and kernel scratch seen at the probe's peak
    }
    if shards > 1:  # the units whole at once beside the shard: the root's own and two units (fsdp_policy)
        gathered = probe.fsdp_gathered_bytes if probe.fsdp_gathered_bytes is not None else probe.param_bytes
        breakdown["gathered"] = math.ceil(gathered * (1 - 1 / shards))  # the rank's own shard is counted above
    return breakdown


def _tokenizer_factor(plan: Plan, probe: Footprint, fraction: float | None, chag: int, worst: bool = False) -> float:
    # Channel groups split the tokenizer's work by chag and rotation keeps k of G groups (docs/design.md), by bands: the
    # tokenizer's work is per band, and groups aligned to spectral regions differ in size. The rest of the model
    # runs on the rank's slice of the samples, the largest ⌈b/chag⌉ (channel_groups.py).
    if fraction is None:
        return 1.0
    rest_share = math.ceil(plan.batch_size / chag) / plan.batch_size
    return (1.0 - fraction) * rest_share + fraction * tokenizer_share(plan, probe, chag, worst)


def tokenizer_share(plan: Plan, probe: Footprint, chag: int, worst: bool = False) -> float:
    """The share of all bands that the most loaded of `chag` ranks tokenises in a step.

    Ranks own G/chag groups each, bands balanced as channel groups run them (group_owners.py). Under rotation a
    rank encodes k/chag of them a step: on average (every group equally often) that share of its bands, and in the
    `worst` step (what memory must hold) its largest k/chag groups. Without group sizes: 1/chag × k/G.
    """
    sizes = probe.band_group_sizes
    rotating = plan.rotation_enabled and bool(sizes)
    if not sizes:
        return 1.0 / chag
    per_rank = len(sizes) // chag
    active = plan.rotation_groups // chag if rotating else per_rank
    owned = [sorted((sizes[g] for g in groups), reverse=True) for groups in rank_groups(sizes, chag)]
    load = [sum(groups[:active]) if worst else sum(groups) * active / per_rank for groups in owned]
    return max(load) / sum(sizes)


def _compute_seconds(plan: Plan, probe: ProbeResult, chag: int, shards: int) -> tuple[float, float]:
    """(per-step compute, last micro-step's backward) on one rank, before any sharing of CPU cores."""
    if plan.batch_size == probe.batch_size:
        fb_seconds = probe.forward_seconds + probe.backward_seconds
    else:
        fb_seconds = probe.compute_c0_seconds + probe.compute_c1_seconds_per_sample * plan.batch_size
    fb_seconds *= _tokenizer_factor(plan, probe, probe.chag_fraction, chag)
    backward_share = probe.backward_seconds / max(probe.forward_seconds + probe.backward_seconds, 1e-12)
    data_seconds = probe.data_seconds * plan.batch_size / probe.batch_size
    optimizer_seconds = probe.optimizer_seconds / shards  # under FSDP each rank steps only its shard
    if shards > 1:  # FSDP's own hooks and DTensor dispatch do not shrink with the shard (measured on one rank)
        fb_seconds += probe.fsdp_micro_overhead_seconds or 0.0
        optimizer_seconds += probe.fsdp_optimizer_overhead_seconds or 0.0
    return plan.accumulate * (fb_seconds + data_seconds) + optimizer_seconds, fb_seconds * backward_share


def _together_seconds(plan: Plan, probe: ProbeResult) -> float | None:
    """A CPU plan's step from its ranks timed stepping together (ranks_together.py), or None: priced from parts.

    Plain DDP or FSDP at the probed batch on as many ranks, and channel groups (any dp × chag mesh of them, with
    the rotation timed, one micro-step); compression and accumulated channel groups are priced from their parts, and
    so are plans across nodes (one node's ranks stepping together are not the job's collectives).
    """
    if plan.accelerator != "cpu" or probe.contention_ranks != plan.devices or probe.batch_size != plan.batch_size:
        return None
    if plan.num_nodes > 1:
        return None
    data = probe.data_seconds
    if plan.fsdp and probe.fsdp_together_seconds:
        micro, optimizer = probe.fsdp_together_seconds
        return plan.accumulate * (micro + data) + optimizer
    if plan.compression != "none":
        return None
    if not plan.chag_enabled and not plan.rotation_enabled and probe.ddp_together_seconds:
        synced, accumulated, optimizer = probe.ddp_together_seconds
        return (plan.accumulate - 1) * (accumulated + data) + synced + data + optimizer
    timed = (probe.chag_together_seconds or {}).get(str(plan.chag))
    if plan.chag_enabled and plan.accumulate == 1 and timed and probe.chag_together_rotation == plan.rotation_groups:
        micro, optimizer = timed
        return micro + data + optimizer
    return None


def predict(
    plan: Plan,
    probe: ProbeResult,
    link: LinkModel,
    device_memory_bytes: int,
    *,
    node_link: LinkModel | None = None,
    cpu_cores: int | None = None,
    ring_factor_exact: bool = True,
    loop_seconds: float = 0.0,
    alone_loop_seconds: float | None = None,
) -> Prediction:
    """Price one plan: step time, throughput, ECD, speed-up, r and per-device memory (docs/design.md).

    `link` carries the data-parallel (and FSDP) collectives, `node_link` those the mapping keeps inside a node:
    channel groups' exchange and a hybrid FSDP shard group's gathers (default: `link`).
    `loop_seconds` is the training loop's measured cost per synchronised micro-step with the plan's ranks,
    `alone_loop_seconds` with one (default: the same), also what an accumulating micro-step costs; see
    `preflight.overhead`. The analytic reference cases leave both at 0.
    On CPU, ranks are processes sharing `cpu_cores` (default: this machine's): compute slows by the probe's measured
    contention for the plan's ranks, else by devices × probe.threads / cores when above 1, and `device_memory_bytes`
    is host memory shared by the ranks.
    """
    notes = _extrapolation_notes(plan, probe)
    oversubscription, cores = _cpu_sharing(plan, probe, cpu_cores, notes)
    shards = plan.shard_ranks if plan.fsdp else 1
    together = _together_seconds(plan, probe) if plan.world_size > 1 else None
    if together is not None:  # measured as it runs: compute, sharing, collectives and the waits between ranks
        compute_seconds, exposed_seconds = together, 0.0
        notes.append(f"step measured with its {plan.devices} ranks stepping together, collectives included")
    else:
        compute_seconds, backward_seconds = (oversubscription * s for s in _compute_seconds(plan, probe, plan.chag,
                                                                                          shards))  # fmt: skip
        compute_seconds *= tail_factor(probe.step_seconds_samples, plan.world_size, plan.accumulate)  # slowest rank
        straggler = tail_note(probe.step_seconds_samples, plan.world_size, plan.accumulate)
        notes.extend([straggler] if straggler else [])
        exposed_seconds = comm_seconds(plan, probe, link, node_link, backward_seconds, ring_factor_exact, notes)
    exposed_seconds += _quantise_seconds(plan, probe, notes)
    regime = comm_regime(plan, probe, link, node_link, ring_factor_exact, exposed_seconds, compute_seconds)
    _unpriced_notes(plan, probe, notes)
    alone_loop_seconds = loop_seconds if alone_loop_seconds is None else alone_loop_seconds
    # Non-final micro-steps run under no_sync: no collective, no optimiser step, so each rank pays only its own loop.
    loop_total_seconds = loop_seconds + (plan.accumulate - 1) * oversubscription * alone_loop_seconds
    step_seconds = compute_seconds + loop_total_seconds + exposed_seconds
    samples_per_second = plan.global_batch / step_seconds
    speedup = samples_per_second / _alone_samples_per_second(plan, probe, alone_loop_seconds)
    breakdown = memory_breakdown_bytes(plan, probe)
    peak_bytes = sum(breakdown.values())
    budget_bytes = memory_budget_bytes(plan, device_memory_bytes)
    return Prediction(
        step_seconds=step_seconds,
        compute_seconds=compute_seconds,
        loop_seconds=loop_total_seconds,
        comm_seconds=exposed_seconds,
        samples_per_second=samples_per_second,
        ecd=samples_per_second / plan.world_size,
        per_device_peak_bytes=peak_bytes,
        fits_memory=peak_bytes <= budget_bytes,
        speedup=speedup,
        chag_bytes_per_step=2 * plan.accumulate * chag_token_bytes(plan, probe),
        grad_bytes_per_step=grad_bytes_per_step(plan, probe),
        r=plan.world_size / speedup - 1.0,
        memory_budget_bytes=budget_bytes,
        memory_breakdown_bytes=breakdown,
        regime=regime,
        oversubscription=oversubscription,
        cpu_cores=cores,
        notes=notes,
    )


def _extrapolation_notes(plan: Plan, probe: ProbeResult) -> list[str]:
    # Where the plan's compute is read off a probe of another step: its precision, or a batch outside b/2..b.
    notes = []
    if probe.precision != plan.precision:
        notes.append(f"probe ran at {probe.precision}, plan uses {plan.precision}: compute not re-measured")
    if not probe.batch_size // 2 <= plan.batch_size <= probe.batch_size:  # the probe timed b/2 and b
        notes.append(f"batch {plan.batch_size} extrapolated from probes at {probe.batch_size // 2}-{probe.batch_size}")
    return notes


def _cpu_sharing(plan: Plan, probe: ProbeResult, cpu_cores: int | None, notes: list[str]) -> tuple[float, int | None]:
    """(compute slow-down from CPU ranks sharing the box, the cores they share): (1.0, None) on GPU."""
    if plan.accelerator != "cpu":
        return 1.0, None
    cores = cpu_cores or len(os.sched_getaffinity(0))
    if probe.contention is not None and probe.contention_ranks == plan.devices:
        notes.append(f"{plan.devices} ranks stepping at once each ran {probe.contention:.2f}× slower than alone")
        return probe.contention, cores  # measured with the plan's ranks stepping at once
    oversubscription = max(1.0, plan.devices * probe.threads / cores)
    if oversubscription > 1:
        notes.append(f"{plan.devices} processes with {probe.threads} thread(s) each share {cores} cores")
    return oversubscription, cores


def _quantise_seconds(plan: Plan, probe: ProbeResult, notes: list[str]) -> float:
    # int8's quantise and dequantise run on the critical path, once per optimiser step (docs/design.md, compressed),
    # on the gradients DDP's buckets hold: band groups' own are summed apart, in fp32 (gradient_split).
    if plan.world_size == 1 or plan.compression != "int8":
        return 0.0
    per_byte = probe.compress_seconds_per_byte
    if per_byte is None:
        per_byte = DEFAULT_COMPRESS_SECONDS_PER_BYTE[plan.accelerator]
        notes.append(f"int8 quantise cost not measured: {plan.accelerator} default {per_byte:.0e} s/byte used")
    ddp_bytes = gradient_split(plan, probe)[0]
    return int8_hook_seconds(ddp_bytes, plan.world_size, per_byte, launch_seconds_on(probe.device))


def _unpriced_notes(plan: Plan, probe: ProbeResult, notes: list[str]) -> None:
    # Features the plan uses whose cost the probe did not measure.
    if plan.fsdp and plan.dp > 1 and probe.fsdp_micro_overhead_seconds is None:
        notes.append("FSDP's own per-unit cost not measured (the probe ran without measure_fsdp): comm only")
    if plan.rotation_enabled and (probe.chag_fraction is None or not probe.band_groups):
        notes.append("rotation not priced: the probe did not measure the tokenizer share or band groups")


def _alone_samples_per_second(plan: Plan, probe: ProbeResult, alone_loop_seconds: float) -> float:
    # The same per-device plan on one rank with the cores to itself: S(N)'s reference.
    alone_seconds = _compute_seconds(plan, probe, 1, 1)[0] + plan.accumulate * alone_loop_seconds
    return plan.batch_size * plan.accumulate / alone_seconds


def memory_budget_bytes(plan: Plan, device_memory_bytes: int) -> int:
    """What one rank may use: CPU ranks share the host's memory; a GPU rank has its device to itself."""
    return device_memory_bytes // plan.devices if plan.accelerator == "cpu" else device_memory_bytes
