"""How much slower a CPU rank's training step runs while the plan's other ranks step on the same box.

CPU ranks share more than cores: the caches and the memory bandwidth. So the count of cores alone under-prices
a rank that steps beside others, and the step is timed with the plan's ranks running it at once instead.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from hslite.allocator import keep_freed_memory
from hslite.preflight.step_timing import timed_step
from hslite.preflight.training_step import CLASSIFIER_STEP, TrainingStep


def measure_contention(
    model: nn.Module,
    batch: Any,
    *,
    ranks: int,
    threads: int,
    precision: str,
    alone_seconds: float,
    step: TrainingStep = CLASSIFIER_STEP,
    warmup: int = 2,
    steps: int = 5,
    window_seconds: float = 0.5,
) -> float:
    """How many times slower a CPU rank's training step runs while `ranks` processes run it at once: at least 1.

    `ranks` spawned processes with `threads` threads each start the probe's step together (a barrier after
    warm-up) and time steps of it for `window_seconds` at least, so that they overlap even when a step takes a
    millisecond; the slowest rank's median, which DDP waits for, over `alone_seconds` (the same step in one process
    with the same threads) is the factor. The spawned processes need the caller's `if __name__ == "__main__":` guard.
    """
    context = torch.multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(ranks), context.SimpleQueue()
    args = (model, batch, threads, precision, step, warmup, steps, window_seconds, barrier, results)
    torch.multiprocessing.start_processes(_contention_rank, args=args, nprocs=ranks, start_method="spawn")
    slowest = max(results.get() for _ in range(ranks))
    return max(1.0, slowest / alone_seconds)


def _contention_rank(
    rank: int,
    model: nn.Module,
    batch: Any,
    threads: int,
    precision: str,
    step: TrainingStep,
    warmup: int,
    steps: int,
    window_seconds: float,
    barrier: Any,
    results: Any,
) -> None:
    torch.set_num_threads(threads)
    keep_freed_memory()
    dev = torch.device("cpu")
    optimizer = step.optimizer(model)
    for _ in range(warmup):
        timed_step(model, optimizer, batch, precision, dev, step)
    barrier.wait()
    timed: list[float] = []
    end = time.monotonic() + window_seconds
    while len(timed) < steps or time.monotonic() < end:
        timed.append(sum(timed_step(model, optimizer, batch, precision, dev, step)))
    results.put(statistics.median(timed))
