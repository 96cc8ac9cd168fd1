"""A CPU plan's ranks timed as the plan runs them: N processes on this box, stepping at once, over one gloo group.

CPU ranks share more than cores: the caches and the memory bandwidth, and gloo's own threads run on the cores the
ranks compute on, so an all-reduce that a GPU hides under backward takes a CPU rank's compute time here, and every
collective waits for the slowest rank. Priced from one rank alone plus the ring formulas, those costs are missing
(CPU plans came out fast: benchmarks/preflight_fidelity.py prints predicted against measured). So the probe spawns
the plan's N ranks and, in one spawn:

1. `contention`: each times the plain step with no process group, all at once (a barrier after warm-up) for
   `window_seconds` at least so that they overlap even when a step takes a millisecond; the slowest rank's median
   over the same step alone is how much slower compute runs beside the others (it prices every layout of N ranks);
2. DDP: the model in DistributedDataParallel over the N ranks' gloo group, as `hslite fit` wraps it: the slowest
   rank's median micro-step that all-reduces (forward, backward, the bucketed all-reduce), one under no_sync (what
   an accumulated micro-step costs) and the optimiser step: plain DDP at this batch, priced as measured;
3. FSDP (when asked): the model sharded with hslite's policy (`fsdp_policy.shard_model`) over the same group, its
   micro-step (gathers and reduce-scatter included) and optimiser step;
4. channel groups (a band-group model): each dp × chag mesh of the ranks whose chag divides its groups (and the
   plan's rotation), with that rotation (`chag_together`): its micro-step and optimiser step.

Each of 2-4 times `window_seconds` of steps at least too, every rank as many (each step holds collectives).

The spawned processes need the caller's `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hslite.parallel.spawned_rank import end_finished_rank
from hslite.preflight_check.measure.chag_together import chag_layouts, chag_step
from hslite.preflight_check.measure.step_timing import timed_step
from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP, TrainingStep
from hslite.process.allocator import keep_freed_memory

MAX_WINDOW_STEPS = 200  # a window of ms-scale steps; slower ones stop at the window


@dataclass(frozen=True)
class Together:
    """What the slowest of N CPU ranks measured stepping at once (seconds; see the module notes)."""

    contention: float  # times slower the plain step runs beside the others than alone, at least 1
    ddp: tuple[float, float, float]  # (all-reducing micro-step, no_sync micro-step, optimiser step)
    fsdp: tuple[float, float] | None  # (micro-step, optimiser step); None when not asked
    chag: dict[int, tuple[float, float]]  # chag size -> (micro-step, optimiser step) of that dp × chag mesh


def measure_together(
    model: nn.Module,
    batch: Any,
    *,
    ranks: int,
    threads: int,
    precision: str,
    alone_seconds: float,
    fsdp: bool = False,
    band_group_sizes: list[int] | None = None,
    rotation_groups: int = 0,
    step: TrainingStep = CLASSIFIER_STEP,
    warmup: int = 2,
    steps: int = 5,
    window_seconds: float = 0.5,
) -> Together:
    """Time `model` on `batch` in `ranks` spawned CPU ranks with `threads` threads each (module notes, 1-3).

    `alone_seconds` is the plain step in one process with the same threads: the contention factor's denominator.
    """
    context = torch.multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(ranks), context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        layouts = chag_layouts(step, band_group_sizes, ranks, rotation_groups)
        settings = (threads, precision, step, warmup, steps, window_seconds, fsdp, band_group_sizes, layouts,
                    rotation_groups)  # fmt: skip
        args = (ranks, init_file, model, batch, settings, barrier, results)
        torch.multiprocessing.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn")
        measured = [results.get() for _ in range(ranks)]
    slowest = [max(column) for column in zip(*measured, strict=True)]
    return Together(
        contention=max(1.0, slowest[0] / alone_seconds),
        ddp=(slowest[1], slowest[2], slowest[3]),
        fsdp=(slowest[4], slowest[5]) if fsdp else None,
        chag={c: (slowest[6 + 2 * i], slowest[7 + 2 * i]) for i, c in enumerate(layouts)},
    )


def _rank(
    rank: int, ranks: int, init_file: str, model: nn.Module, batch: Any, settings: tuple, barrier: Any, results: Any
) -> None:
    threads, precision, step, warmup, steps, window_seconds, fsdp, _, layouts, _ = settings
    torch.set_num_threads(threads)
    keep_freed_memory()
    dev = torch.device("cpu")
    # The layouts after DDP start from the weights before it (DDP hooks the model's parameters); copied only for them
    pristine = copy.deepcopy(model) if fsdp or layouts else model
    model.train()
    optimizer = step.optimizer(model)

    def one_step(module: nn.Module, optimiser: Any) -> list[float]:
        return timed_step(module, optimiser, batch, precision, dev, step)

    for _ in range(warmup):
        one_step(model, optimizer)
    barrier.wait()
    alone: list[float] = []
    end = time.monotonic() + window_seconds
    while len(alone) < steps or time.monotonic() < end:
        alone.append(sum(one_step(model, optimizer)))

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks, timeout=timedelta(seconds=120)
    )
    try:
        figures = [statistics.median(alone), *_in_group(model, pristine, optimizer, batch, settings, rank, ranks)]
        dist.barrier()  # no rank tears the group down while a peer's last collective is still in flight
    finally:
        dist.destroy_process_group()
    results.put(figures)
    end_finished_rank()  # gloo's threads outlive the destroy (DDP's reducer holds the group): ~1 exit in 20 aborted


def _in_group(
    model: nn.Module, pristine: nn.Module, optimizer: Any, batch: Any, settings: tuple, rank: int, ranks: int
) -> list[float]:
    """DDP's, FSDP's and each chag layout's figures (module notes, 2-4)."""
    from torch.nn.parallel import DistributedDataParallel

    from hslite.parallel.strategies.fsdp_policy import shard_model

    _, precision, step, warmup, steps, window_seconds, fsdp, band_group_sizes, layouts, rotation = settings
    dev = torch.device("cpu")
    ddp = DistributedDataParallel(_StepForward(model, step.loss))
    ddp_step = replace(step, loss=_forward)

    def ddp_one_step() -> list[float]:
        return timed_step(ddp, optimizer, batch, precision, dev, ddp_step)

    synced = _timed_steps(ddp_one_step, warmup, steps, window_seconds)
    with ddp.no_sync():
        accumulated = [ddp_one_step()[:2] for _ in synced]
    micro, optimizer_seconds = _micro_and_optimizer(synced)
    figures = [micro, _median_sum(accumulated), optimizer_seconds]
    if fsdp:
        sharded = copy.deepcopy(pristine).train()
        shard_model(sharded, _mesh(ranks), precision)
        sharded_optimizer = step.optimizer(sharded)
        figures += _timed_together(
            partial(timed_step, sharded, sharded_optimizer, batch, precision, dev, step), warmup, steps, window_seconds
        )
    else:
        figures += [0.0, 0.0]
    grouped_step = replace(step, loss=_forward)
    for chag in layouts:
        grouped, grouped_optimizer = chag_step(pristine, band_group_sizes, rank, ranks, chag, rotation)
        figures += _timed_together(
            partial(timed_step, grouped, grouped_optimizer, batch, precision, dev, grouped_step),
            warmup,
            steps,
            window_seconds,
        )
    return figures


class _StepForward(nn.Module):
    """The step's loss as a forward, so DDP wraps what the step runs (a LightningModule's training_step as well)."""

    def __init__(self, module: nn.Module, loss: Any) -> None:
        super().__init__()
        self.module, self.step_loss = module, loss

    def forward(self, batch: Any) -> Tensor:
        return self.step_loss(self.module, batch)


def _forward(module: nn.Module, batch: Any) -> Tensor:
    return module(batch)


def _timed_together(one_step: Any, warmup: int, steps: int, window_seconds: float) -> list[float]:
    return _micro_and_optimizer(_timed_steps(one_step, warmup, steps, window_seconds))


def _timed_steps(one_step: Any, warmup: int, steps: int, window_seconds: float) -> list[list[float]]:
    """`one_step`'s parts, timed over `window_seconds` of steps at least (and `steps`), every rank as many.

    A median of 5 steps of a few milliseconds is one burst of the box's other load away from a third off; a window
    of them is not. Each step holds collectives, so the ranks agree on the count: the largest any rank's window needs.
    """
    fastest = min(sum(one_step()) for _ in range(max(1, warmup)))
    count = torch.tensor([max(steps, min(MAX_WINDOW_STEPS, math.ceil(window_seconds / max(fastest, 1e-6))))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    dist.barrier()  # every rank's timed steps overlap the others'
    return [one_step() for _ in range(int(count))]


def _mesh(ranks: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ranks,))


def _micro_and_optimizer(timed: list[list[float]]) -> list[float]:
    forward, backward, optimizer_step = (statistics.median(column) for column in zip(*timed, strict=True))
    return [forward + backward, optimizer_step]


def _median_sum(timed: list[list[float]]) -> float:
    return statistics.median(sum(parts) for parts in timed)
