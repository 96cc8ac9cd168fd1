"""Declared numeric ranges of dataclass fields: each field says which numbers it accepts, one loop checks them all.

lr: float = ranged(1e-3, POSITIVE)  # checked by range_problems(config) after a recipe is loaded
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any


@dataclass(frozen=True)
class Interval:
    """Numbers a field accepts: one interval, optionally whole or odd numbers only; infinite bounds are open."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    whole: bool = False  # only whole numbers (a float field that may hold a count)
    odd: bool = False  # only odd whole numbers
    name: str = ""  # what the numbers mean, e.g. "a share"; shown before the bounds

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        whole = not (self.whole or self.odd) or value == int(value)
        return above and below and whole and (not self.odd or int(value) % 2 == 1)

    def __str__(self) -> str:
        lo, hi = (str(int(x)) if math.isfinite(x) and x == int(x) else f"{x:g}" for x in (self.lo, self.hi))
        if self.lo == self.hi:
            bounds = lo
        elif self.hi == math.inf:
            bounds = f"{'>' if self.lo_open else '≥'} {lo}"
        elif self.lo == -math.inf:
            bounds = f"{'<' if self.hi_open else '≤'} {hi}"
        else:
            bounds = f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        return f"{self.name} {bounds}".strip()


def ranged(default: Any, *allowed: Interval) -> Any:
    """A dataclass field whose value (or every element, for a list) must lie in one of `allowed`."""
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata={"range": allowed})
    return field(default=default, metadata={"range": allowed})


AT_LEAST_0 = Interval(0)
AT_LEAST_1 = Interval(1)
POSITIVE = Interval(0, lo_open=True)
SHARE = Interval(0, 1, lo_open=True, hi_open=True)
ODD = Interval(1, odd=True, name="an odd number")
# Lightning's limit_*_batches: a float up to 1.0 is a share of the batches, a whole number above 1 a count of them.
BATCH_LIMIT = (
    Interval(0, 1, lo_open=True, name="a share"),
    Interval(1, lo_open=True, whole=True, name="a whole count"),
)
SEED = Interval(0, 2**32 - 1, whole=True)  # numpy's seed range, which pl.seed_everything enforces too


def _flatten(value: Any) -> list[Any]:
    return [x for item in value for x in _flatten(item)] if isinstance(value, list) else [value]


def range_problems(section: Any, prefix: str = "") -> list[str]:
    """One sentence per numeric field, in any section, whose value lies outside its declared range."""
    problems = []
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            problems += range_problems(value, f"{prefix}{f.name}.")
            continue
        allowed = f.metadata.get("range")
        if allowed is None:
            continue
        if any(not any(x in interval for interval in allowed) for x in _flatten(value)):
            each = "every element " if isinstance(value, list) else ""
            problems.append(
                f"{prefix}{f.name}={value} is out of range: {each}must be {' or '.join(map(str, allowed))}."
            )
    return problems
