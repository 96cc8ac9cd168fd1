"""What a training rank used: its peak memory and the bytes it communicated per optimiser step (metrics.json "usage").

Peak memory. GPU: `torch.cuda.max_memory_allocated`, reset at each sampled batch's start. CPU has no allocator
counter, so glibc's `mallinfo2` in-use bytes (what malloc handed out and has not taken back: the analogue of
max_memory_allocated, where RSS would keep freed pages) are read after each forward, after each backward and after
each optimiser step, less what the rank held at setup, plus its parameters (already resident then). Sampled, so a
lower bound of the peak inside backward. A read walks the heap (slow when it is fragmented), so only the first
SAMPLED_STEPS optimiser steps are sampled: once the optimiser state exists every step holds the same tensors.
Validation is not sampled.

Bytes. Counted where hslite's code hands tensors to collectives (the int8 hook, the channel-group token exchange,
band groups' own gradients summed over their owners); computed with the ring formula where it does not (the
bf16/fp16 hooks count that way; plain DDP all-reduces the fp32 gradients it manages once per optimiser step;
FSDP all-gathers the parameters twice and reduce-scatters the fp32 gradients every micro-batch, each moving
(N−1)/N of them per rank, docs/design.md). Both per rank, the most loaded rank's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn.parallel import DistributedDataParallel

from hslite.parallel.host_reduce import max_over_ranks
from hslite.parallel.strategies.fsdp import ShardedStrategy
from hslite.parallel.wire_format import fsdp_wire_bytes, wire_bytes

SAMPLED_STEPS = 3  # step 1 allocates the optimiser state; steps 2-3 are the steady layout
MEMORY_METHODS = {
    "gpu": "CUDA max_memory_allocated per rank during training steps",
    "cpu": "malloc bytes in use per rank (glibc mallinfo2) after each forward, backward and optimiser step of the "
    "first steps, above its bytes at setup, plus its parameters: a sampled lower bound",
}
NAMES = ("peak_memory_bytes", "counted_bytes_per_step", "computed_bytes_per_step")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def _mallinfo2() -> Any:
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2  # glibc ≥ 2.33
    except (AttributeError, OSError, TypeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def malloc_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not taken back (heap arenas + mmapped blocks); None without glibc ≥ 2.33."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class RankUsage(pl.Callback):
    """Per-rank peak memory and bytes communicated per optimiser step, logged as usage/* (max over ranks)."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.counted_bytes = 0
        self.computed_bytes = 0
        self._cuda: torch.device | None = None
        self._setup_excess_bytes: int | None = None  # in use at setup beyond the parameters
        self._sampling = False
        self._at_start: tuple[int, int, int] = (0, 0, 0)
        self._collective_numel = 0  # what DDP or FSDP communicates, counted once: the parameters do not change

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        device = trainer.strategy.root_device
        self._cuda = device if device.type == "cuda" else None
        in_use = malloc_in_use_bytes()
        if self._cuda is None and in_use is not None:
            self._setup_excess_bytes = in_use - sum(p.nbytes for p in pl_module.parameters())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self._collective_numel = sum(p.numel() for p in _collective_parameters(trainer.strategy, pl_module))

    def _sample(self) -> None:
        if not self._sampling:
            return
        if self._cuda is not None:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self._cuda))
        elif self._setup_excess_bytes is not None:
            self.peak_bytes = max(self.peak_bytes, (malloc_in_use_bytes() or 0) - self._setup_excess_bytes)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:  # noqa: D102
        self._sampling = trainer.global_step < SAMPLED_STEPS
        if self._sampling and self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)
        self._at_start = (*_hook_and_token_bytes(trainer), trainer.global_step)

    def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: torch.Tensor) -> None:  # noqa: D102
        self._sample()

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        self._sample()

    def on_train_batch_end(  # noqa: D102
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sample()
        hook_bytes, token_bytes, step = self._at_start
        now_hook, now_token = _hook_and_token_bytes(trainer)
        state = getattr(trainer.strategy, "compression_state", None)
        if state is not None and state.kind == "int8":  # the kind holds for a whole batch (the guard acts at epochs)
            self.counted_bytes += now_hook - hook_bytes
        else:
            self.computed_bytes += now_hook - hook_bytes
        self.counted_bytes += now_token - token_bytes
        strategy, world = trainer.strategy, trainer.world_size
        numel = self._collective_numel
        if state is None and isinstance(strategy.model, DistributedDataParallel) and trainer.global_step > step:
            self.computed_bytes += wire_bytes(numel, world, "none")  # one fp32 all-reduce per optimiser step
        if isinstance(strategy, ShardedStrategy) and world > 1:
            gathered = 2 if strategy.compute_precision == "bf16-mixed" else 4  # fsdp_policy's param_dtype
            shards = world // strategy.replicas  # a node's ranks under hybrid sharding, else all
            self.computed_bytes += round(fsdp_wire_bytes(numel * gathered, numel * 4, shards, strategy.replicas))

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        steps = max(trainer.global_step, 1)
        measured = self._setup_excess_bytes is not None or self._cuda is not None
        values = torch.tensor(
            [self.peak_bytes if measured else math.nan, self.counted_bytes / steps, self.computed_bytes / steps],
            dtype=torch.float64,
        )
        values = max_over_ranks(values)  # on every rank in the same order, as timing.py
        module.log_dict({f"usage/{name}": float(value) for name, value in zip(NAMES, values, strict=True)})


def _hook_and_token_bytes(trainer: pl.Trainer) -> tuple[int, int]:
    """(the compression hook's bytes, the bytes hslite's channel-group collectives moved: tokens, groups' gradients)."""
    state = getattr(trainer.strategy, "compression_state", None)
    groups = getattr(trainer.lightning_module, "channel_groups", None)
    group_gradients = getattr(trainer.strategy, "group_gradients", None)
    counted = (groups.bytes_received if groups is not None else 0) + (
        group_gradients.bytes_sent if group_gradients is not None else 0
    )
    return (state.bytes_sent if state is not None else 0, counted)


def _collective_parameters(strategy: Any, module: pl.LightningModule) -> list[torch.nn.Parameter]:
    """The trained parameters DDP or FSDP communicate (DTensors count their whole size): not band groups' own."""
    group_gradients = getattr(strategy, "group_gradients", None)
    left_out = {id(p) for p in group_gradients.parameters} if group_gradients is not None else set()
    return [p for p in module.parameters() if p.requires_grad and id(p) not in left_out]


def usage_metrics(callback_metrics: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """metrics.json's "usage": what RankUsage logged, with how the memory was measured; None where it was not."""
    values = {name: float(callback_metrics[f"usage/{name}"]) for name in NAMES if f"usage/{name}" in callback_metrics}
    peak = values.get("peak_memory_bytes", math.nan)
    return {
        "peak_memory_bytes": None if math.isnan(peak) else int(peak),
        "peak_memory_method": MEMORY_METHODS[accelerator] if not math.isnan(peak) else None,
        "counted_bytes_per_step": values.get("counted_bytes_per_step"),
        "computed_bytes_per_step": values.get("computed_bytes_per_step"),
    }
