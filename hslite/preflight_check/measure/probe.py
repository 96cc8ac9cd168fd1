"""Probe one device: its measured training step, the features' costs and the CPU ranks' contention, cached.

`probe_model` times a few real training steps of the model on one device (`step_timing`), counts what it holds
(`footprint`), and when asked the tokenizer's share (`activations`), FSDP's and int8's own costs (`feature_costs`)
and the slow-down of CPU ranks stepping at once (`contention`); it caches the result as JSON under the user cache
dir. On CPU the "devices" are processes sharing the cores, so probe with the threads one rank would get:
`threads_per_process(plan)`. On GPU it times with the plan's CUDA math (TF32, cuDNN benchmark) and hands the memory
it cached back to the device when done, so the ranks that start after it find it free.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hslite.cache import read_cache, write_cache
from hslite.errors import ConfigError
from hslite.parallel.box import threads_per_process
from hslite.parallel.plan import PRECISIONS, Plan
from hslite.preflight_check.measure.activations import measure_tokenizer
from hslite.preflight_check.measure.feature_costs import int8_seconds_per_byte, measure_fsdp_overhead
from hslite.preflight_check.measure.ranks_together import measure_together
from hslite.preflight_check.measure.step_timing import device_label, measure_steps
from hslite.preflight_check.measure.timers import cuda_math
from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP, TrainingStep
from hslite.preflight_check.measurements import ProbeResult
from hslite.process.allocator import keeps_freed_memory

PROBE_FIELDS_VERSION = 8  # bump when ProbeResult gains a field or one is measured anew: cached probes are re-measured
PROBE_DEVICE = "cuda:0"  # the one GPU a GPU plan is probed on; the launching process touches no other


@dataclass(frozen=True)
class ProbeTarget:
    """Where and how one step is timed: as one rank of a plan runs it (`of_plan`), or set by hand in a test."""

    batch_size: int
    precision: str
    device: str = "cpu"
    threads: int | None = None  # CPU threads while probing; None keeps the process's
    concurrent_ranks: int = 1  # CPU: also time this many ranks stepping at once (`ranks_together.measure_together`)
    rotation_groups: int = 0  # band groups active per step while those ranks time channel groups; 0: none
    tf32: bool = True  # CUDA only, as Plan.tf32
    cudnn_benchmark: bool = True  # CUDA only, as Plan.cudnn_benchmark

    @classmethod
    def of_plan(cls, plan: Plan) -> ProbeTarget:
        """One rank of `plan`: on PROBE_DEVICE for a GPU plan, else with the threads and company a CPU rank gets."""
        on_gpu = plan.accelerator == "gpu"
        return cls(
            plan.batch_size,
            plan.precision,
            device=PROBE_DEVICE if on_gpu else "cpu",
            threads=None if on_gpu else threads_per_process(plan),
            concurrent_ranks=1 if on_gpu else plan.devices,
            rotation_groups=plan.rotation_groups,
            tf32=plan.tf32,
            cudnn_benchmark=plan.cudnn_benchmark,
        )


@dataclass(frozen=True)
class ProbeOptions:
    """What is measured beyond the plain step, for how long, and whether a cached measurement is read back."""

    step: TrainingStep = CLASSIFIER_STEP  # what one step is: hslite's classifier step, or a LightningModule's own
    warmup: int = 2
    steps: int = 5
    # A choice, not a measured figure: it bounds the check's wait where a step is slow (AMP on a CPU without bf16
    # instructions); a probe cut short times fewer steps, one at each batch at least.
    budget_seconds: float = 10.0
    cache_key: str | None = None  # None: measured and not cached
    fresh: bool = False  # re-measure even where a cached measurement exists
    measure_compression: bool = False  # the int8 hook's kernel work per byte
    measure_fsdp: bool = False  # FSDP2's own cost per step (and with several CPU ranks, FSDP's steps together)
    band_group_sizes: list[int] | None = None  # a band-group model's groups: the tokenizer's share is measured


def probe_for_plans(
    model_factory: Callable[[], nn.Module], make_batch: Callable[[int], Any], options: ProbeOptions = ProbeOptions()
) -> Callable[[Plan], ProbeResult]:
    """A `probe_for` for `run_preflight`: probes one rank of each plan it is given (`ProbeTarget.of_plan`)."""
    return lambda plan: probe_model(model_factory, make_batch, ProbeTarget.of_plan(plan), options)


def probe_model(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], Any],
    target: ProbeTarget,
    options: ProbeOptions = ProbeOptions(),
) -> ProbeResult:
    """Measure one training step of `model_factory()` on one device; cached when `options.cache_key` is given.

    The step is `options.step`'s: its loss on a batch of `make_batch(b)` and its optimiser (hslite's classifier step
    by default, a LightningModule's own through `own_script/lightning_step.lightning_workload`). Times are medians of
    `steps` after `warmup` (at the target's batch, up to TAIL_STEPS for the step-time distribution,
    `step_seconds_samples`), at that batch and at half of it (for c0/c1); the timed loop stops early once
    `budget_seconds` is spent. With `band_group_sizes` (a band-group model) the share of forward time and of
    activation bytes of its per-group work (`encode_group`, which channel groups split) is measured, and its outputs,
    summed over its calls, are the group-token size per sample. `concurrent_ranks` > 1 on CPU also times that many
    ranks stepping at once (`ranks_together.measure_together`: how much slower the plain step runs beside the
    others, DDP's steps over their gloo group and, with `measure_fsdp`, FSDP's), the spawned processes needing the
    caller's `if __name__ == "__main__":` guard. On CUDA every step is timed with `tf32` and `cudnn_benchmark` set
    as training sets them (the process's own settings come back after), and the allocator's cache is emptied once
    measured (`_release_cuda_memory`).
    """
    if target.precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {target.precision!r}.")
    if target.batch_size < 1 or options.steps < 1 or options.warmup < 0:
        raise ConfigError(
            f"probe needs batch_size ≥ 1, steps ≥ 1, warmup ≥ 0; got {target.batch_size}, {options.steps}, "
            f"{options.warmup}."
        )
    dev = torch.device(target.device)
    ranks_together = target.concurrent_ranks if dev.type == "cpu" else 1
    previous_threads = torch.get_num_threads()
    if target.threads is not None:
        torch.set_num_threads(target.threads)
    key = {
        "cache_key": options.cache_key,
        "step": options.step.label,
        "batch_size": target.batch_size,
        "precision": target.precision,
        "device": device_label(dev),
        "threads": torch.get_num_threads(),
        "measure_compression": options.measure_compression,
        "measure_fsdp": options.measure_fsdp,
        "band_group_sizes": options.band_group_sizes,
        "rotation_groups": target.rotation_groups if options.band_group_sizes and ranks_together > 1 else 0,
        "concurrent_ranks": ranks_together if dev.type == "cpu" else 1,
        # The CPU reads neither switch, so a CPU probe is the same measurement whatever the plan says.
        "tf32": target.tf32 if dev.type == "cuda" else None,
        "cudnn_benchmark": target.cudnn_benchmark if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "allocator_keeps_memory": keeps_freed_memory(),
        "fields": PROBE_FIELDS_VERSION,
    }
    try:
        cached = None if options.cache_key is None or options.fresh else read_cache("probe", key)
        if cached is not None:
            return ProbeResult.from_dict(cached)
        with _probing(dev, target.tf32, target.cudnn_benchmark):
            deadline = time.monotonic() + options.budget_seconds
            result = measure_steps(model_factory, make_batch, target.batch_size, target.precision, dev, options.warmup,
                                   options.steps, options.step, deadline)  # fmt: skip
            if options.measure_compression:
                result.compress_seconds_per_byte = int8_seconds_per_byte(result.param_count, dev)
            overhead = None
            if options.measure_fsdp:
                overhead = measure_fsdp_overhead(model_factory, make_batch(target.batch_size), result, options.step,
                                                 options.warmup, options.steps)  # fmt: skip
            if overhead is not None:
                result.fsdp_micro_overhead_seconds, result.fsdp_optimizer_overhead_seconds = overhead
            if options.band_group_sizes:
                torch.manual_seed(0)
                model = model_factory().to(dev).train()
                result.chag_fraction = measure_tokenizer(result, model, make_batch, target.precision, dev, options.step)
                result.band_group_sizes = options.band_group_sizes
            if ranks_together > 1:
                alone_seconds = result.forward_seconds + result.backward_seconds + result.optimizer_seconds
                together = measure_together(model_factory(), make_batch(target.batch_size), ranks=ranks_together,
                                            threads=torch.get_num_threads(), precision=target.precision,
                                            alone_seconds=alone_seconds, fsdp=options.measure_fsdp,
                                            band_group_sizes=options.band_group_sizes,
                                            rotation_groups=target.rotation_groups, step=options.step,
                                            warmup=options.warmup, steps=options.steps)  # fmt: skip
                result.contention, result.contention_ranks = together.contention, ranks_together
                result.ddp_together_seconds = list(together.ddp)
                result.fsdp_together_seconds = list(together.fsdp) if together.fsdp else None
                result.chag_together_seconds = {str(c): list(t) for c, t in together.chag.items()} or None
                result.chag_together_rotation = target.rotation_groups
    finally:
        torch.set_num_threads(previous_threads)
    if options.cache_key is not None:
        write_cache("probe", key, result.to_dict())
    return result


@contextlib.contextmanager
def _probing(dev: torch.device, tf32: bool, cudnn_benchmark: bool) -> Iterator[None]:
    """The plan's CUDA math while the probe measures on `dev`; after it, what the probe cached handed back to CUDA."""
    with cuda_math(tf32, cudnn_benchmark, dev):
        try:
            yield
        finally:
            if dev.type == "cuda":
                _release_cuda_memory()


def _release_cuda_memory() -> None:
    """Hand what the probe's models, optimisers and batches left in torch's CUDA caches back to the device.

    Freed tensors stay reserved by this process's caching allocator, and the ranks start after the probe (in other
    processes, or this one with other tensors): without this they would find the probe's peak missing from their
    GPU, and `gate` prices the memory free after the probe. FSDP2's state and its module refer to each other, so a
    sharded model is freed by the cycle collector, not on return; cuBLAS keeps its workspaces outside what
    `empty_cache` releases (pytorch/pytorch#95668; Lightning's CUDA teardown clears those two the same way).
    """
    gc.collect()
    clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_cublas_workspaces is not None:  # absent from CPU builds of torch
        clear_cublas_workspaces()
    torch.cuda.empty_cache()
