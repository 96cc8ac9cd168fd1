"""Device-aware timing for the probe: CUDA events on GPU, perf_counter on CPU, the plan's AMP and CUDA math."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hslite.parallel.cuda_math import restore_cuda_math, set_cuda_math


def autocast(precision: str, dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The autocast a Lightning `precision` string runs the forward under on `dev` (none for 32-true).

    As Lightning's MixedPrecision plugin (lightning/pytorch/plugins/precision/amp.py) enters it: without autocast's
    cache of cast weights, so a weight used several times in one forward (a tokenizer shared by band groups) is cast,
    and its copy saved for backward, at each use, as in training.
    """
    if precision == "32-true":
        return contextlib.nullcontext()
    # Lightning runs "16-mixed" on CPU as bf16, so the probe does the same.
    dtype = torch.float16 if precision == "16-mixed" and dev.type == "cuda" else torch.bfloat16
    return torch.autocast(dev.type, dtype=dtype, cache_enabled=False)


def grad_scaler(precision: str, dev: torch.device) -> torch.amp.GradScaler | None:
    """The loss scaler Lightning's precision plugin trains `precision` with on `dev`, or None where it uses none.

    Lightning's MixedPrecision makes a `torch.amp.GradScaler` for "16-mixed" only, and runs "16-mixed" on CPU as
    "bf16-mixed" (its accelerator connector), whose range needs no scaling: a scaler on a GPU and nowhere else.
    """
    if precision != "16-mixed" or dev.type != "cuda":
        return None
    return torch.amp.GradScaler(device=dev.type)


def scaled_optimizer_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """The optimiser step of Lightning's MixedPrecision with a scaler, once backward has run on the scaled loss.

    Gradients are unscaled first (a pass over all of them, and the inf check that the step reads back on the host),
    unless the optimiser unscales inside its own step (a fused one); the step is skipped on an overflow and the
    scale updated after it.
    """
    # Lightning's test (lightning/fabric/plugins/precision/amp.py, _optimizer_handles_unscaling), without the import
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


@contextlib.contextmanager
def cuda_math(tf32: bool, cudnn_benchmark: bool, dev: torch.device) -> Iterator[None]:
    """A plan's TF32 and cuDNN-benchmark switches while timing on `dev`, the process's own settings restored after.

    The ranks train with them (`rank_setup.set_cuda_math`), and they change what is timed: TF32 runs fp32 matmuls and
    convolutions on tensor cores (an A100's datasheet: 156 TFLOP/s against 19.5 in fp32), and cuDNN's benchmark
    picks other kernels. A probe without them prices another step. Nothing on CPU: it reads neither switch.
    """
    if dev.type != "cuda":
        yield
        return
    previous = set_cuda_math(tf32, cudnn_benchmark)
    try:
        yield
    finally:
        restore_cuda_math(previous)


def mark(dev: torch.device) -> Any:
    """A point in time on `dev`: a CUDA event recorded on `dev`'s current stream (no sync), perf_counter elsewhere."""
    if dev.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    # On `dev`'s stream, not the current device's: an event recorded on another GPU's stream times that GPU's work.
    event.record(torch.cuda.current_stream(dev))
    return event


def intervals_seconds(marks: list[Any], dev: torch.device) -> list[float]:
    """Seconds between consecutive marks (synchronises a GPU once, at the end)."""
    if dev.type != "cuda":
        return [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    torch.cuda.synchronize(dev)
    return [a.elapsed_time(b) / 1000 for a, b in zip(marks[:-1], marks[1:], strict=True)]


def wall_seconds(fn: Callable[[], Any], dev: torch.device) -> float:
    """Wall-clock seconds of `fn()`, including the GPU work it queued and none that was queued before it."""
    if dev.type == "cuda":
        # GPU work queued earlier (a warm-up call, a model's copy to the device) would otherwise run inside the
        # timed window: the host returns from queuing long before the GPU finishes.
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start
