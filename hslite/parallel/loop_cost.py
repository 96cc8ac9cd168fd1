"""The training loop's own cost per micro-step, measured with the real loop around a model that does almost nothing.

The probe times bare forward, backward and optimiser calls. A `hslite fit` step also pays Lightning's loop and hooks,
the task's loss and metric updates and logging, and under DDP the reducer's bookkeeping and the ranks meeting at
each all-reduce. For a small model that is as much as its whole step, and left out it made a small model's DDP plan
miss its prediction badly. So it is measured, not assumed: `Trainer.fit` of `HSIClassifier` around a linear layer,
with the Plan's own Trainer arguments (the same strategy and ranks), timed by the callback that times `hslite fit`.
The linear layer's compute and its one latency-bound all-reduce are inside the figure; both are small against what
they stand for.

It lives beside the code that builds trainers, not in `preflight/`: the pre-flight never builds a Trainer, it is
handed `measure_step_overhead` as a callable (`hslite.recipe.gate`).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import warnings
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from hslite.cache import read_cache, write_cache
from hslite.errors import HSLiteError
from hslite.parallel.box import threads_per_process
from hslite.parallel.launched import leave_the_job
from hslite.parallel.plan import Plan
from hslite.parallel.rank_setup import quiet_lightning
from hslite.parallel.timing import TrainThroughput
from hslite.parallel.trainer_args import trainer_kwargs
from hslite.task import HSIClassifier

STEPS_PER_RANK = 40  # medians of 39 batches settle within a few percent here
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
    kwargs["callbacks"].append(TrainThroughput())
    trainer = pl.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, **kwargs
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no `val_dataloader`")  # no validation is the point here
        trainer.fit(HSIClassifier(nn.Linear(FEATURES, num_classes), num_classes), train_dataloaders=loader)
    seconds = float(trainer.callback_metrics["perf/median_batch_seconds"])  # the slowest rank's
    if not launched:
        write_cache("overhead", _cache_key(loop_plan, num_classes), {"step_seconds": seconds})
    return seconds


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
    return None if cached is None else float(cached["step_seconds"])


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
