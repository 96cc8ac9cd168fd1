"""Time a model's training step on one device: forward, backward, optimiser and data, and a linear compute model.

`measure_steps` runs a few real steps at the requested batch and at half of it (CUDA events on GPU), each on a batch
gathered just before it as training's are (the gathers are the data time), and fits T(b) = c0 + c1·b to the two;
`timed_step` is the one step every timing of the pre-flight repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hslite.preflight.footprint import counted_peak_bytes, model_sizes
from hslite.preflight.formulas import fit_compute_model
from hslite.preflight.measurements import ProbeResult
from hslite.preflight.tail import TAIL_SECONDS, TAIL_STEPS
from hslite.preflight.timers import autocast, intervals_seconds, mark
from hslite.preflight.training_step import TrainingStep, batch_to

# Of the probe's time budget, the share the requested batch may spend; the half batch, timed warm, gets the rest.
FULL_BATCH_SHARE = 0.6


def device_label(dev: torch.device) -> str:
    """`dev` as the probe records it: a GPU with its model name, so a cached probe is not read for another GPU."""
    return f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else str(dev)


def timed_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    precision: str,
    dev: torch.device,
    step: TrainingStep,
) -> list[float]:
    """One training step: seconds of forward (with the loss), backward, and the optimiser step with zero_grad."""
    marks = [mark(dev)]
    with autocast(precision, dev):
        loss = step.loss(model, batch)
    marks.append(mark(dev))
    loss.backward()
    marks.append(mark(dev))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks.append(mark(dev))
    return intervals_seconds(marks, dev)


def measure_steps(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], Any],
    batch_size: int,
    precision: str,
    dev: torch.device,
    warmup: int,
    steps: int,
    step: TrainingStep,
    deadline: float,
) -> ProbeResult:
    """Median step times at `batch_size` and half of it, the fitted c0 + c1·b, and the model's sizes on `dev`.

    Timed steps stop early at `deadline` (time.monotonic()), after one step at each batch at least. The peak is
    what CUDA's allocator saw on a GPU; elsewhere the sum of the counted terms (`footprint.model_sizes`).
    """
    torch.manual_seed(0)
    model = model_factory().to(dev).train()
    optimizer = step.optimizer(model)

    def batch_on_device(b: int) -> Any:
        return batch_to(make_batch(b), dev)

    def one_step(batch: Any) -> list[float]:
        return timed_step(model, optimizer, batch, precision, dev, step)

    gathers: list[float] = []

    def gathered(b: int) -> Any:
        start = time.perf_counter()  # the GPU is idle here: every timed step ends with a synchronize
        batch = batch_on_device(b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        gathers.append(time.perf_counter() - start)
        return batch

    def timed_steps(b: int, stop_at: float, warmup_steps: int, wanted: int) -> list[list[float]]:
        if warmup_steps:  # no batch gathered for none: on a GPU its queued copy would run in the first gather's time
            batch = batch_on_device(b)
            for _ in range(warmup_steps):
                one_step(batch)
        # Each timed step gets a batch gathered just before it, as in training: stepping on one batch again and again
        # finds its input in cache and nothing evicting the weights between steps, and timed one-device steps up to
        # 20 % (median 11 %) faster than `hslite fit` ran them (benchmarks/preflight_fidelity.py).
        timed = [one_step(gathered(b))]
        while len(timed) < wanted and time.monotonic() < stop_at:
            timed.append(one_step(gathered(b)))
        return timed

    def medians(timed: list[list[float]]) -> list[float]:
        return [statistics.median(column) for column in zip(*timed, strict=True)]

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    now = time.monotonic()
    # The full batch's steps are also the sample of the step-time distribution that prices the slowest rank (tail.py):
    # `steps` at least, up to TAIL_STEPS within TAIL_SECONDS.
    stop_at = now + FULL_BATCH_SHARE * (deadline - now)
    timed = timed_steps(batch_size, stop_at, warmup, steps)
    if len(timed) < TAIL_STEPS:
        timed += timed_steps(batch_size, min(stop_at, time.monotonic() + TAIL_SECONDS), 0, TAIL_STEPS - len(timed))
    forward_seconds, backward_seconds, optimizer_seconds = medians(timed)
    data_seconds = statistics.median(gathers)  # the full batch's, each gathered beside the training it feeds
    gpu_peak_bytes = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    half_batch = batch_size // 2 if batch_size > 1 else 2
    half_forward, half_backward, _ = medians(timed_steps(half_batch, deadline, min(warmup, 1), steps))  # warm now
    c0, c1 = fit_compute_model(
        [batch_size, half_batch], [forward_seconds + backward_seconds, half_forward + half_backward]
    )
    sizes = model_sizes(model, optimizer, batch_on_device(batch_size), precision, dev, step)
    return ProbeResult(
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        optimizer_seconds=optimizer_seconds,
        data_seconds=data_seconds,
        batch_size=batch_size,
        precision=precision,
        threads=torch.get_num_threads(),
        device=device_label(dev),
        **sizes,
        peak_bytes=gpu_peak_bytes if gpu_peak_bytes is not None else counted_peak_bytes(sizes),
        compute_c0_seconds=c0,
        compute_c1_seconds_per_sample=c1,
        step_seconds_samples=sorted(sum(step_times) for step_times in timed),
    )
