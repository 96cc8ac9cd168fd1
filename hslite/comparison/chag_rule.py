"""The rule for channel groups, judged on measurement: > 5 % faster steps than plain DP, accuracy unchanged.

docs/design.md, channel-group benefit: adopt channel groups only when the step is more than 5 % faster than plain
DP on the same devices at the same global batch, at unchanged accuracy.
Each measured channel-group row is set against the measured plain-DP row of the same work (`chag_benefit.
dp_counterparts`: the chag ranks' shared micro-batch split among them, or their accumulated micro-batches split).
Speed is judged on any measured comparison; accuracy needs whole trainings (`accuracy=true`: every row trains its
recipe's schedule and reports its test OA), and is unchanged when the two OAs are within OA_TOLERANCE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hslite.parallel.plan import Plan
from hslite.preflight_check.price.chag_benefit import CHAG_ADOPT_GAIN, dp_counterparts

if TYPE_CHECKING:
    from hslite.comparison.rows import CompareRow

# A choice: one point of OA. Channel groups compute plain DP's gradient up to rounding, so a larger gap between
# the two trainings is a difference of what was trained (rotation, another recipe), not of the layout.
OA_TOLERANCE = 0.01


def judge_channel_groups(rows: list[CompareRow], workloads: list[str | None]) -> None:
    """Set `plain_dp`, `step_gain` and `chag_rule` on every measured channel-group row (`workloads`: `_workload`)."""
    timed = {
        (work, row.plan): row
        for row, work in zip(rows, workloads, strict=True)
        if work is not None and row.measured_step_seconds is not None
    }
    for row, work in zip(rows, workloads, strict=True):
        if work is None or row.requested_plan is None or row.measured_step_seconds is None:
            continue
        plan = Plan(**row.requested_plan)
        if not plan.chag_enabled:
            continue
        counterparts = [p.describe() for p in dp_counterparts(plan)]
        base = next((timed[(work, p)] for p in counterparts if (work, p) in timed), None)
        if base is None or base.measured_step_seconds is None:
            row.chag_rule = f"not judged: no measured plain-DP row of its work; add {' or '.join(counterparts)}"
            continue
        row.plain_dp = base.label
        row.step_gain = 1.0 - row.measured_step_seconds / base.measured_step_seconds
        row.chag_rule = _rule(row.step_gain, row.test_oa, base.test_oa, base.label)


def _rule(gain: float, oa: float | None, base_oa: float | None, base: str) -> str:
    speed = f"step {gain:.1%} faster than {base}" if gain >= 0 else f"step {-gain:.1%} slower than {base}"
    if gain <= CHAG_ADOPT_GAIN:
        return f"reject: {speed}, not more than {CHAG_ADOPT_GAIN:.0%}"
    if oa is None or base_oa is None:
        return f"faster: {speed}; accuracy not checked (accuracy=true trains both to the end)"
    delta = oa - base_oa
    if abs(delta) > OA_TOLERANCE:
        return f"reject: {speed} but OA {oa:.2%} against {base_oa:.2%} ({delta:+.2%}, beyond ±{OA_TOLERANCE:.0%})"
    return f"adopt: {speed} at OA {oa:.2%} against {base_oa:.2%} (within ±{OA_TOLERANCE:.0%})"
