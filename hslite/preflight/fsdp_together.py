"""FSDP's step on CPU timed as the plan runs it: its N ranks sharded over one gloo group, stepping together.

FSDP2 gathers each unit before its forward and backward and reduce-scatters its gradients after, so a rank waits at
every unit for the slowest of its peers; priced from one rank's sharded step (`measure_fsdp_overhead`) plus the ring
formulas, those waits are missing and CPU plans came out 12-48 % fast. Here the plan's ranks are spawned on this box
in a process group of their own, each shards the model with hslite's policy (`fsdp_policy.shard_model`), and they
time the same steps at once: the slowest rank's median micro-step (forward and backward, the collectives included)
and optimiser step are the plan's, with the sharing of cores, caches and memory bandwidth in them too.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from hslite.allocator import keep_freed_memory
from hslite.preflight.step_timing import timed_step
from hslite.preflight.training_step import CLASSIFIER_STEP, TrainingStep


def measure_fsdp_together(
    model: nn.Module,
    batch: Any,
    *,
    ranks: int,
    threads: int,
    precision: str,
    step: TrainingStep = CLASSIFIER_STEP,
    warmup: int = 2,
    steps: int = 5,
) -> tuple[float, float]:
    """(micro-step seconds, optimiser-step seconds) of the slowest of `ranks` CPU ranks training `model` under FSDP.

    Every rank gets `model` (the same weights) and `batch`, shards it over the ranks' gloo group and times `warmup`
    then `steps` steps; the spawned processes need the caller's `if __name__ == "__main__":` guard.
    """
    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        args = (ranks, init_file, model, batch, threads, precision, step, warmup, steps, results)
        torch.multiprocessing.start_processes(_fsdp_rank, args=args, nprocs=ranks, start_method="spawn")
        timings = [results.get() for _ in range(ranks)]
    return max(micro for micro, _ in timings), max(optimizer for _, optimizer in timings)


def _fsdp_rank(
    rank: int,
    ranks: int,
    init_file: str,
    model: nn.Module,
    batch: Any,
    threads: int,
    precision: str,
    step: TrainingStep,
    warmup: int,
    steps: int,
    results: Any,
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hslite.parallel.fsdp_policy import shard_model

    torch.set_num_threads(threads)
    keep_freed_memory()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks, timeout=timedelta(seconds=120)
    )
    try:
        dev = torch.device("cpu")
        shard_model(model.train(), init_device_mesh("cpu", (ranks,)), precision)
        optimizer = step.optimizer(model)
        for _ in range(warmup):
            timed_step(model, optimizer, batch, precision, dev, step)
        dist.barrier()  # every rank's timed steps overlap the others'
        timed = [timed_step(model, optimizer, batch, precision, dev, step) for _ in range(steps)]
    finally:
        dist.destroy_process_group()
    forward, backward, optimizer_step = (statistics.median(column) for column in zip(*timed, strict=True))
    results.put((forward + backward, optimizer_step))
