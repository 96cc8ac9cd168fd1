"""The straggler: a synchronous step waits for the slowest of its ranks, so a rank's step is priced at a tail.

The probe times many steps of one rank (`TAIL_STEPS`, within `TAIL_SECONDS`), a sample of its step-time
distribution. Of N ranks drawing from it independently, the slowest is at or below the q-quantile with probability
q^N, so the median step of N ranks is the distribution's 0.5^(1/N) quantile: p50 alone, p71 for 2 ranks, p84 for
4, p92 for 8, p96 for 16. That is the percentile a plan of N ranks is priced at (docs/design.md,
straggler tail), against the median that prices one device, and it is what `hslite compare` measures: a fit's median
optimiser step. Accumulated micro-steps are waited for once per G: the sum of G independent micro-steps spreads
√G times less relative to its size, so the tail's excess over the median shrinks by √G.

Ranks on one box share noise (one CPU's other load slows them all), so independence is the upper bound of the wait.
Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

MIN_TAIL_SAMPLES = 8  # below this the tail is not priced (the note says so)


def slowest_rank_quantile(ranks: int) -> float:
    """The quantile of one rank's step time that is the median of the slowest of `ranks` ranks: 0.5^(1/ranks)."""
    return 0.5 ** (1.0 / max(ranks, 1))


def quantile(samples: Sequence[float], q: float) -> float:
    """The q-quantile of `samples`, linearly interpolated between order statistics (numpy's default)."""
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def tail_factor(samples: Sequence[float] | None, ranks: int, accumulate: int = 1) -> float:
    """How much longer the step of `ranks` synchronised ranks takes than one rank's median step: at least 1.

    1 for one rank, or when fewer than MIN_TAIL_SAMPLES steps were timed.
    """
    if ranks <= 1 or not samples or len(samples) < MIN_TAIL_SAMPLES:
        return 1.0
    median = statistics.median(samples)
    excess = quantile(samples, slowest_rank_quantile(ranks)) / median - 1.0
    return 1.0 + max(0.0, excess) / math.sqrt(max(accumulate, 1))


def tail_note(samples: Sequence[float] | None, ranks: int, accumulate: int) -> str | None:
    """What the pricing did about the slowest rank, in words; None for one rank."""
    if ranks <= 1:
        return None
    if not samples or len(samples) < MIN_TAIL_SAMPLES:
        return f"straggler wait not priced: the probe timed {len(samples or [])} steps (fewer than {MIN_TAIL_SAMPLES})"
    q = slowest_rank_quantile(ranks)
    factor = tail_factor(samples, ranks, accumulate)
    per = f" over {accumulate} micro-steps" if accumulate > 1 else ""
    return (f"each rank's step priced at its p{100 * q:.0f} of {len(samples)} timed steps (the median slowest of "
            f"{ranks} ranks{per}): ×{factor:.3f} its median")  # fmt: skip
