"""The analytic formulas of docs/design.md: ring collectives, bytes on the wire, the DDP step, c0 + c1·b and P*.

Small functions with units in their names, each citing its source; torch-free. `ring_factor_exact=False` switches to
the simplified bound (2(N−1)/N → 2, one latency per collective, i.e. T_comm ≈ alpha + 2·S/BW as in docs/design.md's
P* line), which is what the reference cases assume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hslite.preflight_check.measurements import LinkModel


def _ring_seconds(phases: int, total_bytes: float, world_size: int, link: LinkModel, exact: bool) -> float:
    # Ring collectives (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009): each phase is N−1 steps of
    # S/N bytes. All-gather and reduce-scatter are one phase, all-reduce is both.
    if world_size <= 1 or total_bytes <= 0:
        return 0.0
    n, bw = world_size, link.bandwidth_bytes_per_second
    if not exact:  # the simplified bound: latency once, (N−1)/N → 1
        return link.alpha_seconds + phases * total_bytes / bw
    return phases * (n - 1) * link.alpha_seconds + phases * (n - 1) / n * total_bytes / bw


def allreduce_seconds(grad_bytes: float, world_size: int, link: LinkModel, *, ring_factor_exact: bool = True) -> float:
    """Ring all-reduce: 2(N−1)·alpha + 2(N−1)/N·S/BW (docs/design.md)."""
    return _ring_seconds(2, grad_bytes, world_size, link, ring_factor_exact)


def allgather_seconds(total_bytes: float, world_size: int, link: LinkModel, *, ring_factor_exact: bool = True) -> float:
    """Ring all-gather of a `total_bytes` result: (N−1)·alpha + (N−1)/N·S/BW."""
    return _ring_seconds(1, total_bytes, world_size, link, ring_factor_exact)


def alltoall_seconds(output_bytes: float, world_size: int, link: LinkModel, *, ring_factor_exact: bool = True) -> float:
    """All-to-all writing `output_bytes` on each rank, (N−1)/N of it from the others in N−1 pairwise rounds.

    (N−1)·alpha + (N−1)/N·S/BW: the ring all-gather's cost for a result of the same size.
    """
    return _ring_seconds(1, output_bytes, world_size, link, ring_factor_exact)


def reduce_scatter_seconds(
    total_bytes: float, world_size: int, link: LinkModel, *, ring_factor_exact: bool = True
) -> float:
    """Ring reduce-scatter of a `total_bytes` input: (N−1)·alpha + (N−1)/N·S/BW."""
    return _ring_seconds(1, total_bytes, world_size, link, ring_factor_exact)


@dataclass(frozen=True)
class CriticalParams:
    """Where data parallelism pays on a link by model size: P*, and on which side of it (docs/design.md's sign rule)."""

    params: float | None  # P*; None where DP pays at every size ("always") or at none ("never")
    pays: str  # "above": for P ≥ P*; "below": for P ≤ P*; "always"; "never"

    def pays_at(self, params: float) -> bool:
        """Whether DP reaches r ≤ r* for a model of `params` parameters on this link."""
        if self.params is None:
            return self.pays == "always"
        return params >= self.params if self.pays == "above" else params <= self.params


def critical_params(
    c0_seconds: float,
    c1_seconds_per_param_sample: float,
    batch_size: int,
    fixed_comm_seconds: float,
    comm_seconds_per_param: float,
    *,
    r_target: float = 1.0,
) -> CriticalParams:
    """P* = (alpha − r*·c0) / (r*·c1·b − beta): the model size where DP's r crosses r* (docs/design.md).

    From T_c ≈ c0 + c1·P·b and T_comm ≈ alpha + beta·P (alpha = `fixed_comm_seconds`, beta =
    `comm_seconds_per_param`; the simplified bound has alpha the link latency and beta = 2·b_g/BW,
    `ring_allreduce_terms` a ring's): DP pays where alpha + beta·P ≤ r*·(c0 + c1·P·b). c1 here is per parameter and
    sample: a probe's `compute_c1_seconds_per_sample / param_count`. The denominator's sign says which side pays:
    > 0, models of P* parameters and up (every size when P* ≤ 0); < 0, models up to P* (when r*·c0 > alpha: the
    compute's fixed part hides the latency), none when P* < 0.
    """
    numerator = fixed_comm_seconds - r_target * c0_seconds
    denominator = r_target * c1_seconds_per_param_sample * batch_size - comm_seconds_per_param
    if denominator == 0:
        return CriticalParams(None, "always" if numerator <= 0 else "never")
    p_star = numerator / denominator
    if denominator > 0:
        return CriticalParams(p_star, "above") if p_star > 0 else CriticalParams(None, "always")
    return CriticalParams(p_star, "below") if p_star > 0 else CriticalParams(None, "never")


def ring_allreduce_terms(link: LinkModel, world_size: int, grad_element_bytes: float) -> tuple[float, float]:
    """(alpha, beta) of a ring all-reduce of P gradients as alpha + beta·P: 2(N−1)·latency, 2(N−1)/N·b_g/BW."""
    return 2 * (world_size - 1) * link.alpha_seconds, (
        2 * (world_size - 1) / world_size * grad_element_bytes / link.bandwidth_bytes_per_second
    )
