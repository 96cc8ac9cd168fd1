"""FLOPs and kernel launches of one training step of the model itself, counted on fake tensors (docs/design.md).

FLOPs come from `torch.utils.flop_counter.FlopCounterMode`: matmuls and convolutions, forward and backward;
elementwise ops count 0 there, and the memory roof prices them instead (`roofline.py`). They are counted at two small
batches, so FLOPs(b) = c0 + c1·b holds exactly for models whose work is per sample, whatever batch is priced.
Kernels are the ops a step dispatches that launch one on a GPU (views, detach, allocations, host-side scalars and
fake tensors' device queries left out): what an eager step issues, a lower bound since cuDNN may launch several per
convolution. The step is the one that trains (`training_step.TrainingStep`): hslite's AdamW (foreach kernels, CUDA's
default too) counts as it would on a GPU. The model is built and stepped inside `fake_tensors.fake_mode`: nothing is
allocated, so a model larger than this box counts in seconds, and the counts equal those of its real tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hslite.cache import read_cache, write_cache
from hslite.preflight.activations import around_group_work
from hslite.preflight.fake_tensors import fake_batch, fake_mode
from hslite.preflight.measurements import StepCounts
from hslite.preflight.timers import autocast
from hslite.preflight.training_step import CLASSIFIER_STEP, TrainingStep, batch_bytes

# Two small batches the FLOPs are counted at (BatchNorm in training needs 2): FLOPs are c0 + c1·b beyond them
COUNT_BATCHES = (2, 4)
_NO_KERNEL = {
    torch.ops.aten.detach,
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.lift_fresh,
    torch.ops.aten._local_scalar_dense,  # .item() of AdamW's step counters, which live on the host
}


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it that launch a kernel on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if launches_kernel(func):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def launches_kernel(func: Any) -> bool:
    """Whether an aten op dispatched in a TorchDispatchMode launches a kernel on a GPU (views and the like do not)."""
    return not func.is_view and func.namespace not in ("profiler", "prim") and func.overloadpacket not in _NO_KERNEL


def count_step(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], Any],
    *,
    precision: str,
    band_groups: bool = False,
    step: TrainingStep = CLASSIFIER_STEP,
    cache_key: str | None = None,
    fresh: bool = False,
) -> StepCounts:
    """FLOPs per phase (c0 + c1·b), kernels per phase and input bytes of one training step, under the plan's autocast.

    A band-group model's per-group work (`encode_group`) also gives its share of forward FLOPs, which channel groups
    divide, when `band_groups`.
    Cached like the probe when `cache_key` is given (a bf16 count takes seconds on an AVX2 CPU); `fresh=True` recounts.
    """
    key = {"cache_key": cache_key, "precision": precision, "band_groups": band_groups,
           "step": step.label, "torch": torch.__version__}  # fmt: skip
    cached = None if cache_key is None or fresh else read_cache("step_counts", key)
    if cached is not None:
        return StepCounts(**cached)
    dev = torch.device("cpu")
    flops: dict[int, tuple[float, float]] = {}
    tokenizer_flops = 0.0
    with fake_mode() as mode:  # nothing allocated: a model larger than this box is counted in seconds
        torch.manual_seed(0)
        model = model_factory().train()
        optimizer = step.optimizer(model)
        for batch_size in COUNT_BATCHES:
            batch = fake_batch(mode, make_batch, batch_size)
            forward_counter, forward_kernels = FlopCounterMode(display=False), KernelCounter()
            with forward_counter, forward_kernels, autocast(precision, dev), _group_flops(model, band_groups) as group:
                loss = step.loss(model, batch)
            backward_counter, backward_kernels = FlopCounterMode(display=False), KernelCounter()
            with backward_counter, backward_kernels:
                loss.backward()
            optimizer.step()  # the first step makes AdamW's state; the counted one below is a steady-state step
            optimizer_kernels = KernelCounter()
            with optimizer_kernels:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            flops[batch_size] = (float(forward_counter.get_total_flops()), float(backward_counter.get_total_flops()))
            tokenizer_flops = sum(group)
    (b1, (f1, g1)), (b2, (f2, g2)) = sorted(flops.items())
    counts = StepCounts(
        model=type(model).__name__,
        precision=precision,
        forward_flops_per_sample=(f2 - f1) / (b2 - b1),
        forward_flops_fixed=max(0.0, f1 - (f2 - f1) / (b2 - b1) * b1),
        backward_flops_per_sample=(g2 - g1) / (b2 - b1),
        backward_flops_fixed=max(0.0, g1 - (g2 - g1) / (b2 - b1) * b1),
        forward_kernels=forward_kernels.kernels,
        backward_kernels=backward_kernels.kernels,
        optimizer_kernels=optimizer_kernels.kernels,
        input_bytes_per_sample=batch_bytes(batch) // b2,
        tokenizer_flops_fraction=tokenizer_flops / f2 if band_groups and f2 > 0 else None,
    )
    if cache_key is not None:
        write_cache("step_counts", key, counts.to_dict())
    return counts


@contextmanager
def _group_flops(model: nn.Module, band_groups: bool) -> Iterator[list[int]]:
    """FLOPs of each `encode_group` call inside the block (none unless `band_groups`): the per-group work's."""
    flops: list[int] = []
    if not band_groups:
        yield flops
        return
    counters: list[FlopCounterMode] = []

    def enter() -> None:  # a counter per call: entering one clears its counts
        counters.append(FlopCounterMode(display=False))
        counters[-1].__enter__()

    def leave(_: Any) -> None:
        counter = counters.pop()
        counter.__exit__(None, None, None)
        flops.append(counter.get_total_flops())

    with around_group_work(model, enter, leave):
        yield flops
