"""FLOPs and kernel launches of one training step of the model itself, counted on fake tensors (docs/design.md).

FLOPs come from `torch.utils.flop_counter.FlopCounterMode`: matmuls and convolutions, forward and backward, the
convolutions' share apart; every other kernel counts 0 FLOPs there and its bytes (inputs and outputs) instead, which
the roofline prices at memory speed (`roofline.py`). They are counted at two small batches, so FLOPs(b) = c0 + c1·b
holds exactly for models whose work is per sample, whatever batch is priced, and the bytes the same way.
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
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from hslite.cache import read_cache, write_cache
from hslite.preflight_check.measure.activations import around_group_work
from hslite.preflight_check.measure.fake_tensors import fake_batch, fake_mode
from hslite.preflight_check.measure.timers import autocast
from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP, TrainingStep, batch_bytes
from hslite.preflight_check.measurements import StepCounts

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


# What a step's work is counted as, each c0 + c1·b (StepCounts' {name}_per_sample and {name}_fixed)
WORK = ("forward_flops", "backward_flops", "forward_conv_flops", "backward_conv_flops", "forward_bytes",
        "backward_bytes")  # fmt: skip
_CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten._convolution, torch.ops.aten.convolution_backward}


class KernelCounter(TorchDispatchMode):
    """The aten ops dispatched inside it that launch a kernel on a GPU, with their work by kind.

    `conv_flops`: the convolutions' FLOPs (torch's flop formulas, as FlopCounterMode); `bytes`: inputs and outputs of
    every kernel that is neither a matmul nor a convolution (a lower bound on its traffic: each tensor once).
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.conv_flops = 0.0
        self.bytes = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_kernel(func):
            self.kernels += 1
            packet = func.overloadpacket
            if packet in _CONVOLUTIONS:
                self.conv_flops += flop_registry[packet](*args, **kwargs, out_val=out)
            elif packet not in flop_registry and packet is not torch.ops.aten._unsafe_view:  # a relabelled shape
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


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
           "step": step.label, "torch": torch.__version__, "work": "by kind"}  # fmt: skip
    cached = None if cache_key is None or fresh else read_cache("step_counts", key)
    if cached is not None:
        return StepCounts(**cached)
    dev = torch.device("cpu")
    work: dict[int, tuple[float, ...]] = {}  # each of WORK at one batch
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
            work[batch_size] = (float(forward_counter.get_total_flops()), float(backward_counter.get_total_flops()),
                                forward_kernels.conv_flops, backward_kernels.conv_flops, forward_kernels.bytes,
                                backward_kernels.bytes)  # fmt: skip
            tokenizer_flops = sum(group)
    (b1, small), (b2, large) = sorted(work.items())
    lines = {name: _line(b1, w1, b2, w2) for name, w1, w2 in zip(WORK, small, large, strict=True)}
    counts = StepCounts(
        model=type(model).__name__,
        precision=precision,
        **{
            f"{name}_{part}": value
            for name, line in lines.items()
            for part, value in zip(("per_sample", "fixed"), line, strict=True)
        },
        optimizer_bytes=optimizer_kernels.bytes,
        forward_kernels=forward_kernels.kernels,
        backward_kernels=backward_kernels.kernels,
        optimizer_kernels=optimizer_kernels.kernels,
        input_bytes_per_sample=batch_bytes(batch) // b2,
        tokenizer_flops_fraction=tokenizer_flops / large[0] if band_groups and large[0] > 0 else None,
    )
    if cache_key is not None:
        write_cache("step_counts", key, counts.to_dict())
    return counts


def _line(b1: int, w1: float, b2: int, w2: float) -> tuple[float, float]:
    """(per sample, fixed) of work counted w1 at batch b1 and w2 at b2; the fixed part no less than 0."""
    per_sample = (w2 - w1) / (b2 - b1)
    return per_sample, max(0.0, w1 - per_sample * b1)


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
