"""Time a model's training step on one device: forward, backward, optimiser and data, and a linear compute model.

`measure_steps` runs a few real steps at the requested batch and at half of it (CUDA events on GPU), each on a batch
gathered just before it as training's are, and fits T(b) = c0 + c1·b to the two; `timed_step` is the one step every
timing of the pre-flight repeats, with the loss scaling Lightning adds under "16-mixed" on a GPU.

The data time is the gather and the batch's copy to the device, timed as `hslite fit` runs them on a GPU. Lightning
moves a batch with a `non_blocking` `.to` on the stream the step runs on (`move_data_to_device`), and a stream runs
its work in order, so the copy runs on the device before the step's kernels, never beside them; from page-locked
memory the host does not wait for it and goes on issuing the step's kernels meanwhile. So the probe queues the copy
just before the step, without a wait between them, as training does: where the device would have waited for the
host, the copy hides under the forward's issue and the forward's time shows it; where the device is busy, it adds.
The gather does not overlap the previous step: with more than one rank Lightning reads a broadcast flag back on the
host before it fetches each batch (`_broadcast_sigterm_tensor`), which waits for the device to finish that step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lightning_utilities import apply_to_collection
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.preflight_check.measure.footprint import counted_peak_bytes, model_sizes
from hslite.preflight_check.measure.timers import autocast, grad_scaler, intervals_seconds, mark, scaled_optimizer_step
from hslite.preflight_check.measure.training_step import TrainingStep, batch_to
from hslite.preflight_check.measurements import ProbeResult

# Of the probe's time budget, the share the requested batch may spend; the half batch, timed warm, gets the rest.
FULL_BATCH_SHARE = 0.6


# A choice, not a measured figure: enough steps that the p92 of 8 ranks (price/tail.py) has several samples above
# it (1/(1 − q) ≈ 12 steps per sample beyond it), bounded in time so a slow model's probe keeps to its budget.
TAIL_STEPS = 60
TAIL_SECONDS = 1.5


def fit_compute_model(batch_sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares c0, c1 of T_c(b) ≈ c0 + c1·b (docs/design.md) from ≥ 2 batch sizes; both clipped at ≥ 0."""
    if len(set(batch_sizes)) < 2:
        raise ConfigError(f"the compute model needs ≥ 2 distinct batch sizes, got {sorted(set(batch_sizes))}.")
    b, t = np.asarray(batch_sizes, dtype=float), np.asarray(seconds, dtype=float)
    c0, c1 = np.linalg.lstsq(np.stack([np.ones_like(b), b], 1), t, rcond=None)[0]
    if c1 < 0:  # timing noise larger than the batch effect: the step time is all fixed cost
        return float(t.mean()), 0.0
    if c0 < 0:  # no measurable fixed cost: a line through the origin
        return 0.0, float(b @ t / (b @ b))
    return float(c0), float(c1)


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
    scaler: torch.amp.GradScaler | None = None,
) -> list[float]:
    """One training step: seconds of forward (with the loss), backward, and the optimiser step with zero_grad.

    With `scaler` (`timers.grad_scaler`) it is the step of Lightning's MixedPrecision: backward of the scaled loss, and
    the unscale, inf check, step and scale update in the optimiser's time.
    """
    marks = [mark(dev)]
    with autocast(precision, dev):
        loss = step.loss(model, batch)
    marks.append(mark(dev))
    (loss if scaler is None else scaler.scale(loss)).backward()
    marks.append(mark(dev))
    if scaler is None:
        optimizer.step()
    else:
        scaled_optimizer_step(scaler, optimizer)
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
    scaler = grad_scaler(precision, dev)  # one for the whole probe, as for a run: its scale settles in the warm-up

    def batch_on_device(b: int) -> Any:
        return batch_to(make_batch(b), dev)

    data: list[float] = []  # per timed step: its batch's gather and copy

    def fed_step(b: int) -> list[float]:
        start = time.perf_counter()  # the GPU is idle here: every timed step ends with a synchronize
        batch = _as_loaded(make_batch(b), dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # a batch gathered on the GPU (data.gather_on_device) is its kernels' work
        gather_seconds = time.perf_counter() - start
        copy = [mark(dev)]
        on_device = batch_to(batch, dev)  # queued as Lightning queues it, the step right behind it (module notes)
        copy.append(mark(dev))
        step_times = timed_step(model, optimizer, on_device, precision, dev, step, scaler)
        data.append(gather_seconds + intervals_seconds(copy, dev)[0])
        return step_times

    def timed_steps(b: int, stop_at: float, warmup_steps: int, wanted: int) -> list[list[float]]:
        if warmup_steps:  # no batch gathered for none: on a GPU its queued copy would run in the first gather's time
            batch = batch_on_device(b)
            for _ in range(warmup_steps):
                timed_step(model, optimizer, batch, precision, dev, step, scaler)
        # Each timed step gets a batch gathered just before it, as in training: stepping on one batch again and again
        # finds its input in cache and nothing evicting the weights between steps, and timed one-device steps faster
        # than `hslite fit` ran them (benchmarks/preflight_fidelity.py prints predicted against measured).
        timed = [fed_step(b)]
        while len(timed) < wanted and time.monotonic() < stop_at:
            timed.append(fed_step(b))
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
    data_seconds = statistics.median(data)  # the full batch's, each gathered beside the training it feeds
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


def _as_loaded(batch: Any, dev: torch.device) -> Any:
    """`batch` as a DataLoader hands it to Lightning for `dev`: page-locked throughout where its data path pins.

    hslite's datamodule gathers a GPU plan's patches straight into page-locked memory and its DataLoader pins the rest
    of each batch (the labels); a copy to the GPU from pageable memory would hold the host until it has run. A batch
    with nothing page-locked comes from a loader that does not pin (a script's own) and is copied as it is.
    """
    if dev.type != "cuda":
        return batch
    host: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: host.append(t) if t.device.type == "cpu" else None)
    if not any(t.is_pinned() for t in host):
        return batch
    return apply_to_collection(batch, Tensor, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
