"""Channel groups against their alternative, plain DP on the same devices at the same global batch.

R_agg = (T_comm of DP − T_comm of the groups) / T_comp of the groups, and the step-time gain asked of grouping before
adopting it (docs/design.md, channel-group benefit). Torch-free.
"""

from __future__ import annotations

from typing import Any

from hslite.parallel.plan import Plan
from hslite.preflight_check.price.costmodel import Prediction

# Channel groups are adopted only when they cut the step time by more than this, at unchanged accuracy
# (docs/design.md, channel-group benefit).
CHAG_ADOPT_GAIN = 0.05


def dp_counterparts(plan: Plan) -> list[Plan]:
    """Plain DP over a channel-group plan's devices at its global batch ([] without channel groups).

    The chag ranks' shared micro-batch split among them, or their accumulated micro-batches.
    """
    counterparts = []
    if plan.chag_enabled and plan.batch_size % plan.chag == 0:
        counterparts.append(plan.with_(chag=1, batch_size=plan.batch_size // plan.chag))
    if plan.chag_enabled and plan.accumulate % plan.chag == 0:
        counterparts.append(plan.with_(chag=1, accumulate=plan.accumulate // plan.chag))
    return counterparts


def against_plain_dp(plan: Plan, predictions: dict[Plan, Prediction]) -> dict[str, Any]:
    """A channel-group plan against plain DP on its devices at its global batch (docs/design.md, channel-group benefit).

    R_agg = (T_comm of DP − T_comm of the groups) / T_comp of the groups: > 0 is a net communication gain. hslite
    adopts grouping only when the step is more than CHAG_ADOPT_GAIN faster at unchanged accuracy (`hslite compare
    measure=true accuracy=true` checks the accuracy). None for plans without channel groups or without that DP
    counterpart.
    """
    base = next((p for p in dp_counterparts(plan) if p in predictions), None)
    if base is None:
        return {"benefit_ratio": None, "step_gain": None, "clears_chag_rule": None, "plain_dp": None}
    ours, theirs = predictions[plan], predictions[base]
    gain = 1 - ours.step_seconds / theirs.step_seconds
    return {
        "plain_dp": base.describe(),
        "benefit_ratio": (theirs.comm_seconds - ours.comm_seconds) / ours.compute_seconds,
        "step_gain": gain,
        "clears_chag_rule": gain > CHAG_ADOPT_GAIN,
    }
