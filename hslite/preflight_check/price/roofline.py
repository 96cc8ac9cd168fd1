"""A probe of a device that is not here, priced from its profile: the roofline of docs/design.md (what-if pricing).

Each phase of a training step (forward, backward, optimiser) runs its kernels one after another, each kind at its
own share of its rate:
    T ≈ max(matmul FLOPs / (peak · e_matmul) + convolution FLOPs / (peak · e_conv) + bytes / (memory BW · e_memory),
            kernels · launch)
all counted on the model's own step (`step_counts.py`): the bytes are the inputs and outputs of every kernel that is
neither a matmul nor a convolution (normalisations, activations, casts, reductions, the optimiser's). The last roof
is the host's: eager PyTorch issues a kernel per aten op, asynchronously, so a phase cannot end before its kernels
are issued; for small models it is the roof that binds. Torch-free.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hslite.preflight_check.hardware.device_profile import PROFILE_PREFIX, DeviceProfile
from hslite.preflight_check.measure.step_timing import fit_compute_model
from hslite.preflight_check.measurements import Footprint, ProbeResult, StepCounts

KINDS = ("matmul", "conv", "memory")  # run in series on the device
_BOUND = {"matmul": "bound by its matmuls", "conv": "bound by its convolutions", "memory": "memory-bound",
          "launch": "bound by the host's kernel launches"}  # fmt: skip


def roofline_seconds(work: tuple[float, float, float, int], profile: DeviceProfile, precision: str) -> float:
    """One phase on the profile's device: its kinds in series, or the issue of its kernels if that is longer.

    `work`: (matmul FLOPs, convolution FLOPs, other kernels' bytes, kernels), as `StepCounts.phase_work` gives it.
    """
    return _phase_seconds(_roofs_seconds(work, profile, precision))


def _phase_seconds(roofs: dict[str, float]) -> float:
    return max(sum(roofs[kind] for kind in KINDS), roofs["launch"])


def copy_added_seconds(
    copy_seconds: float, *, issue_seconds: float, device_seconds: float, launch_seconds: float
) -> float:
    """Seconds a batch's copy from page-locked memory adds to the GPU step it feeds: its launch, and what is not hidden.

    Lightning queues the copy (`non_blocking`) on the stream the step runs on, and a stream runs its work in order:
    the device copies before it runs the step's kernels, never beside them. The host does not wait for a copy from
    page-locked memory and issues the step's kernels meanwhile, so the step, which takes max(issue, device) alone,
    takes max(issue, copy + device) after it: a step bound by its kernel launches hides the copy under its issue's
    lead on the device, one the device is busy with adds all of it. Without a copy (a CPU plan, a batch gathered on
    the GPU) nothing is added, and the data time is the gather, in series with the step.
    """
    if copy_seconds <= 0:
        return 0.0
    return launch_seconds + max(issue_seconds, copy_seconds + device_seconds) - max(issue_seconds, device_seconds)


def _roofs_seconds(work: tuple[float, float, float, int], profile: DeviceProfile, precision: str) -> dict[str, float]:
    matmul_flops, conv_flops, moved_bytes, kernels = work
    peak, e = profile.peak_flops(precision), profile.efficiencies
    return {
        "matmul": matmul_flops / (peak * e["matmul"]),
        "conv": conv_flops / (peak * e["conv"]),
        "memory": moved_bytes / (profile.memory_gbps * 1e9 * e["memory"]),
        "launch": kernels * profile.launch_us * 1e-6,
    }


def profile_probe(
    batch_size: int, sizes: Footprint, counts: StepCounts, profile: DeviceProfile, gather_seconds: float
) -> ProbeResult:
    """What a probe on the profile's device would measure at `batch_size`, from the model's counts and sizes.

    `gather_seconds` is the host's batch gather (timed on this CPU: the same work the GPU box's host does); the
    batch's copy to the device crosses the profile's host link from page-locked memory, as hslite's GPU plans copy
    it, and adds to the step what the forward does not hide of it (`copy_added_seconds`). c0 + c1·b is fitted on b
    and b/2, like the probe.
    """

    def seconds(b: int) -> dict[str, float]:
        work = counts.phase_work(b)
        return {phase: roofline_seconds(kinds, profile, counts.precision) for phase, kinds in work.items()}

    other_batch = batch_size // 2 if batch_size > 1 else 2  # the probe's second batch
    times, other = seconds(batch_size), seconds(other_batch)
    forward_roofs = _roofs_seconds(counts.phase_work(batch_size)["forward"], profile, counts.precision)
    copy_seconds = copy_added_seconds(
        counts.input_bytes_per_sample * batch_size / (profile.host_gbps * 1e9),
        issue_seconds=forward_roofs["launch"],
        device_seconds=sum(forward_roofs[kind] for kind in KINDS),
        launch_seconds=profile.launch_us * 1e-6,
    )
    c0, c1 = fit_compute_model(
        [batch_size, other_batch], [times["forward"] + times["backward"], other["forward"] + other["backward"]]
    )
    activation_bytes = round(sizes.activation_bytes * batch_size / sizes.batch_size)
    # The four terms only: the absent device's allocator and kernel workspace is not known.
    held_bytes = sizes.param_bytes + sizes.grad_bytes + sizes.optimizer_bytes + activation_bytes
    footprint = {f.name: getattr(sizes, f.name) for f in fields(Footprint)}
    footprint.update(batch_size=batch_size, activation_bytes=activation_bytes, peak_bytes=held_bytes,
                     device=f"{PROFILE_PREFIX}{profile.name}")  # fmt: skip
    return ProbeResult(
        **footprint,
        forward_seconds=times["forward"],
        backward_seconds=times["backward"],
        optimizer_seconds=times["optimizer"],
        data_seconds=gather_seconds + copy_seconds,
        threads=1,
        compute_c0_seconds=c0,
        compute_c1_seconds_per_sample=c1,
        chag_fraction=counts.tokenizer_flops_fraction,
    )


def roofline_summary(counts: StepCounts, profile: DeviceProfile, batch_size: int) -> dict[str, Any]:
    """What the profile's pricing used, for preflight.json: peaks, efficiencies, FLOPs, and each phase's roofs."""
    return {
        "profile": profile.name,
        "model": counts.model,
        "efficiencies": profile.efficiencies,
        "launch_us": profile.launch_us,
        "peak_flops": profile.peak_flops(counts.precision),
        "memory_gbps": profile.memory_gbps,
        "precision": counts.precision,
        "batch_size": batch_size,
        "flops_per_sample": counts.forward_flops_per_sample + counts.backward_flops_per_sample,
        "flops_fixed": counts.forward_flops_fixed + counts.backward_flops_fixed,
        "phases": {
            phase: {
                "matmul_flops": work[0],
                "conv_flops": work[1],
                "bytes": work[2],
                "kernels": work[3],
                **{f"{roof}_seconds": s for roof, s in _roofs_seconds(work, profile, counts.precision).items()},
            }
            for phase, work in counts.phase_work(batch_size).items()
        },
    }


def profile_reasons(summary: dict[str, Any], plan: str) -> list[str]:
    """Where the compute came from and which roof binds, in words (the first reasons of a profile's verdict)."""
    name, e = summary["profile"], summary["efficiencies"]
    gflop = summary["flops_per_sample"] / 1e9
    roofs = {roof: sum(phase[f"{roof}_seconds"] for phase in summary["phases"].values()) for roof in (*KINDS, "launch")}
    kernels = sum(phase["kernels"] for phase in summary["phases"].values())
    device = sum(roofs[kind] for kind in KINDS)
    binding = "launch" if roofs["launch"] > device else max(KINDS, key=lambda kind: roofs[kind])
    return [
        f"compute priced from the {name} profile (roofline by kernel kind: matmuls at e = {e['matmul']:g}, "
        f"convolutions {e['conv']:g}, other kernels' bytes {e['memory']:g}; {summary['model']} {gflop:.3g} GFLOP per "
        f"sample forward+backward): not measured",
        f"one micro-step of {plan} on {name}: its matmuls need {roofs['matmul'] * 1e3:.3g} ms, its convolutions "
        f"{roofs['conv'] * 1e3:.3g} ms, its other kernels' memory traffic {roofs['memory'] * 1e3:.3g} ms, issuing its "
        f"{kernels} kernels {roofs['launch'] * 1e3:.3g} ms at {summary['launch_us']:g} µs each: {_BOUND[binding]}",
    ]
