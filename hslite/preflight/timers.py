"""Device-aware timing for the probe: CUDA events on GPU, perf_counter on CPU, and the plan's autocast."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch


def autocast(precision: str, dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The autocast a Lightning `precision` string runs the forward under on `dev` (none for 32-true)."""
    if precision == "32-true":
        return contextlib.nullcontext()
    # Lightning runs "16-mixed" on CPU as bf16, so the probe does the same.
    dtype = torch.float16 if precision == "16-mixed" and dev.type == "cuda" else torch.bfloat16
    return torch.autocast(dev.type, dtype=dtype)


def mark(dev: torch.device) -> Any:
    """A point in time on `dev`: a recorded CUDA event on GPU (no sync), perf_counter elsewhere."""
    if dev.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def intervals_seconds(marks: list[Any], dev: torch.device) -> list[float]:
    """Seconds between consecutive marks (synchronises a GPU once, at the end)."""
    if dev.type != "cuda":
        return [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    torch.cuda.synchronize(dev)
    return [a.elapsed_time(b) / 1000 for a, b in zip(marks[:-1], marks[1:], strict=True)]


def wall_seconds(fn: Callable[[], Any], dev: torch.device) -> float:
    """Wall-clock seconds of `fn()`, including the GPU work it queued."""
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start
