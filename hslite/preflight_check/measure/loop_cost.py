"""The training loop's own cost per micro-step, measured with the real loop around a model that does almost nothing.

The probe times bare forward, backward and optimiser calls. A `hslite fit` step also pays Lightning's loop and hooks,
the task's loss and metric updates and logging, and under DDP the reducer's bookkeeping and the ranks meeting at
each all-reduce. For a small model that is as much as its whole step, and left out it made a small model's DDP plan
miss its prediction badly. So it is measured, not assumed: `Trainer.fit` of `HSIClassifier` around a linear layer,
with the Plan's own Trainer arguments (the same strategy and ranks), timed by the callback that times `hslite fit`.

The figure also holds the linear layer's own step, and with several ranks their meeting at its gradient all-reduce,
while every plan prices its own model's step and all-reduce (the probe; its ranks timed stepping together, or the
link model). Counted in both, CPU plans were priced well over their fit (benchmarks/preflight_fidelity.py prints
predicted against measured). So the same ranks, right after the loop, time the same layer's bare step (under
DDP when there are several; `BareStepTimer`), and the loop's cost is the figure net of it: what Lightning, the
metrics and the logging add around a step.

It is the one measurement here that builds a Trainer (with `hslite.parallel`'s Trainer arguments, the ones `fit`
builds), so the pricing stages take it as a plain callable, `loop_seconds_for` (`hslite.recipe.gate` hands it in).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
import warnings
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from hslite.cache import read_cache, write_cache
from hslite.errors import HSLiteError
from hslite.parallel.box import threads_per_process
from hslite.parallel.host_reduce import max_over_ranks
from hslite.parallel.plan import Plan
from hslite.parallel.ranks.launched import leave_the_job
from hslite.parallel.ranks.rank_setup import quiet_lightning
from hslite.parallel.timing import TrainThroughput
from hslite.parallel.trainer.trainer_args import trainer_kwargs
from hslite.task import HSIClassifier

STEPS_PER_RANK = 40  # a choice: enough batches for a median that the first, slow one does not move
BATCH_SIZE = 64  # the loop's cost hardly depends on the batch; the metrics' updates see a realistic one
FEATURES = 8


def measure_step_overhead(plan: Plan, num_classes: int, *, fresh: bool = False, launched: bool = False) -> float:
    """Seconds per micro-step the loop adds for `plan`'s ranks on this box; cached per (ranks, accelerator, host).

    Spawns the plan's ranks like `hslite fit` does (CPU ranks with cores ÷ N threads), so the caller needs the
    `if __name__ == "__main__":` guard when it is a script. `launched`: every rank of a launched job calls this and
    the job's own ranks, on every node, are timed (never cached: a node without the record would not join).
    """
    loop_plan = Plan(devices=plan.devices, num_nodes=plan.num_nodes, accelerator=plan.accelerator,
                     batch_size=BATCH_SIZE)  # fmt: skip
    cached = None if fresh or launched else cached_step_overhead(plan, num_classes)
    if cached is not None:
        return cached

    quiet_lightning()
    generator = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(BATCH_SIZE, FEATURES, generator=generator), torch.randint(0, num_classes, (BATCH_SIZE,)))
        for _ in range(STEPS_PER_RANK * loop_plan.world_size)
    ]
    # Ready batches (a list is a map-style dataset): no per-sample collate to time; DDP gives each rank its share.
    loader = DataLoader(cast("Dataset[tuple[Tensor, Tensor]]", batches), batch_size=None)
    kwargs = trainer_kwargs(loop_plan, progress=False, launched=launched)
    kwargs["callbacks"] += [TrainThroughput(), BareStepTimer(num_classes)]
    trainer = pl.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, **kwargs
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no `val_dataloader`")  # no validation is the point here
        trainer.fit(HSIClassifier(nn.Linear(FEATURES, num_classes), num_classes), train_dataloaders=loader)
    figures = {  # the slowest rank's
        "step_seconds": float(trainer.callback_metrics["perf/median_batch_seconds"]),
        "bare_step_seconds": float(trainer.callback_metrics["perf/bare_step_seconds"]),
    }
    if not launched:
        write_cache("overhead", _cache_key(loop_plan, num_classes), figures)
    return _net_of_bare_step(figures)


def measure_step_overhead_apart(plan: Plan, num_classes: int, *, fresh: bool = False) -> float:
    """`measure_step_overhead` in a process of its own: for a caller that is a rank of a launched job.

    A Trainer built in such a rank finds the job's process group initialised (torchmetrics syncs its metrics over
    it, with ranks that are not training) and the launcher's variables (Lightning takes them for its own job); the
    loop is measured in a spawned process that has neither.
    """
    cached = None if fresh else cached_step_overhead(plan, num_classes)
    if cached is not None:
        return cached
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    child = context.Process(target=_measure_apart, args=(queue, plan, num_classes, fresh))
    child.start()
    child.join()
    if child.exitcode != 0 or queue.empty():
        raise HSLiteError(
            f"the training loop's cost could not be measured in a process of its own (it ended with exit code "
            f"{child.exitcode}); its output above says why, or set preflight.enabled=false to train unchecked."
        )
    return float(queue.get())


def _measure_apart(queue: Any, plan: Plan, num_classes: int, fresh: bool) -> None:
    leave_the_job()
    queue.put(measure_step_overhead(plan, num_classes, fresh=fresh))


def cached_step_overhead(plan: Plan, num_classes: int) -> float | None:
    """What `measure_step_overhead` measured before for `plan`'s ranks on this host, or None: never measures.

    For a caller that cannot start a Trainer of its own (`PreflightGate`, inside the launched job's ranks).
    """
    loop_plan = Plan(devices=plan.devices, num_nodes=plan.num_nodes, accelerator=plan.accelerator,
                     batch_size=BATCH_SIZE)  # fmt: skip
    cached = read_cache("overhead", _cache_key(loop_plan, num_classes))
    if cached is None or "bare_step_seconds" not in cached:  # a record from before the bare step was timed
        return None
    return _net_of_bare_step(cached)


def _net_of_bare_step(figures: dict[str, float]) -> float:
    return max(0.0, figures["step_seconds"] - figures["bare_step_seconds"])  # two medians: noise cannot price below 0


class BareStepTimer(pl.Callback):
    """After the loop, the same ranks time the loop's layer stepping alone: what the loop figure holds of a step.

    A fresh linear layer of the loop's shape (in DistributedDataParallel when there are several ranks, as `hslite
    fit` wraps a model), with the loop's optimiser class, stepped back-to-back on its own batch (no Lightning, no
    metrics), as the probe times a model's step and a plan's ranks stepping together (`preflight.ranks_together`):
    subtracting like from like leaves what Lightning's loop adds around a step. On CUDA each step is waited for
    before its clock stops (kernels and NCCL are asynchronous). The slowest rank's median, logged as
    `perf/bare_step_seconds`.
    """

    def __init__(self, num_classes: int, repeats: int = STEPS_PER_RANK) -> None:
        self.num_classes, self.repeats = num_classes, repeats

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        from torch.nn.parallel import DistributedDataParallel

        device = trainer.strategy.root_device
        layer: nn.Module = nn.Linear(FEATURES, self.num_classes).to(device)
        if trainer.world_size > 1:
            layer = DistributedDataParallel(layer, device_ids=[device] if device.type == "cuda" else None)
            dist.barrier()  # every rank's timed steps overlap the others'
        loops_optimizer: Any = type(trainer.optimizers[0])  # its own defaults: what a step costs, not its rate
        optimizer = loops_optimizer(layer.parameters())
        x = torch.randn(BATCH_SIZE, FEATURES, device=device)
        y = torch.randint(0, self.num_classes, (BATCH_SIZE,), device=device)
        seconds = []
        for _ in range(self.repeats + 2):  # the first two rebuild DDP's buckets and warm the optimiser
            start = time.perf_counter()
            nn.functional.cross_entropy(layer(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        median = torch.tensor(statistics.median(seconds[2:]), dtype=torch.float64)
        module.log("perf/bare_step_seconds", float(max_over_ranks(median)))


def _cache_key(loop_plan: Plan, num_classes: int) -> dict[str, object]:
    return {
        "ranks": loop_plan.devices,
        "nodes": loop_plan.num_nodes,
        "accelerator": loop_plan.accelerator,
        "threads": threads_per_process(loop_plan) if loop_plan.accelerator == "cpu" else None,
        "classes": num_classes,
        "host": socket.gethostname(),
        "lightning": pl.__version__,
        "torch": torch.__version__,
    }
