"""Which resource bounds a plan's step, and the lever that pays in it (docs/design.md, regime).

    compute-bound        exposed communication ≪ compute:      optimise the compute (AMP, fused kernels, compile)
    latency-bound        communication comparable, most of it  synchronise less often (accumulation: fewer,
                         per-message latency (alpha):          larger all-reduces)
    communication-bound  communication comparable, most of it  move fewer bytes (channel groups, compression,
                         bytes on the wire:                    sharding)

"≪" is a stated threshold, COMPUTE_BOUND_MAX_R, not a measured one; so is the default bar of a GO verdict,
DEFAULT_MIN_EFFICIENCY. Torch-free.
"""

from __future__ import annotations

# Exposed communication below this share of compute is "≪" it: at most a tenth of the step left to gain there.
COMPUTE_BOUND_MAX_R = 0.1
# GO needs E = ECD(N)/ECD(1) at least this by default: N devices doing at least half of N times one device's work,
# which is r ≤ 1, communication no longer than compute (docs/design.md, efficiency and verdict).
DEFAULT_MIN_EFFICIENCY = 0.5

LEVERS = {
    "compute-bound": "optimise the compute: AMP, fused kernels, torch.compile",
    "latency-bound": "synchronise less often: gradient accumulation (fewer, larger all-reduces)",
    "communication-bound": "move fewer bytes: channel groups, int8/bf16 compression, FSDP sharding",
}


def plan_regime(
    exposed_comm_seconds: float, latency_seconds: float, wire_seconds: float, compute_seconds: float
) -> str:
    """The regime of a step from its exposed communication, that communication's latency and byte parts, and compute.

    `latency_seconds` and `wire_seconds` split the plan's communication (none of it hidden) into the per-message
    latency it pays and the bytes it moves; a one-device plan communicates nothing and is compute-bound.
    """
    if exposed_comm_seconds <= COMPUTE_BOUND_MAX_R * compute_seconds:
        return "compute-bound"
    return "latency-bound" if latency_seconds >= wire_seconds else "communication-bound"
