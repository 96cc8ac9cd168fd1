"""What every rank sets up for itself: its CPU thread budget, its allocator, CUDA's math settings and a quiet Lightning.

Spawned ranks start as fresh interpreters, so settings made in the launching process (threads, warning filters,
log levels) do not reach them; this callback applies them inside each rank before the first step.
"""

from __future__ import annotations

import logging
import os
import warnings

import lightning.pytorch as pl
import torch

from hslite.parallel.cuda_math import set_cuda_math
from hslite.process.allocator import keep_freed_memory


def quiet_lightning() -> None:
    """Silence Lightning's start-up chatter at its source; hslite prints its own summary, and warnings still show.

    The info logger carries hardware banners and sales tips ("try litlogger"); the pytree FutureWarning is Lightning's
    own use of a torch API it has not migrated (lightning 2.6 with torch ≥ 2.10) and says nothing about hslite's code.
    The `sync_dist` advice is for perf/, usage/ and the torchmetrics values, which hslite reduces on every rank
    itself (timing.py, usage.py, task.py): a lazy sync_dist reduction on whichever rank reads first deadlocks under
    the progress bar.
    """
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('(perf|usage|train|val|test)/")
    # A run's checkpoint folder is new, or a resumed run's own (run/resume.py): its files are meant to be there.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


# cuBLAS picks reduction orders per call unless its workspace is fixed; torch raises at the first cuBLAS call under
# use_deterministic_algorithms without it (torch's "Reproducibility" notes). Read at each call, so setting it before
# training is early enough even where the pre-flight probe already used cuBLAS in this process.
CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(deterministic: bool) -> None:
    """Deterministic kernels only (or not), in this process: torch's switch and the cuBLAS workspace it needs."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(deterministic)  # set either way: it is global to the process


class RankSetup(pl.Callback):
    """Apply the thread budget, train.deterministic, CUDA's math settings and quiet logging in every rank, at setup.

    In a library call's own process these are set back when the call returns (`hslite.process.caller_state`).

    Oversubscribed gloo runs (N processes × all cores) run many times slower and make step times meaningless;
    the pre-flight probe measures a rank with exactly cores ÷ N threads, so training must use the same.
    """

    def __init__(
        self,
        threads: int | None,
        deterministic: bool = False,
        tf32: bool = True,
        cudnn_benchmark: bool = True,
        spawned: bool = False,
    ) -> None:
        self.threads = threads
        self.spawned = spawned  # the ranks are processes hslite started: their allocator is hslite's to set
        self.deterministic = deterministic  # train.deterministic: Lightning sets it in the launching process only
        self.tf32 = tf32
        # cuDNN's benchmark mode chooses kernels by timing them, which is not deterministic.
        self.cudnn_benchmark = cudnn_benchmark and not deterministic

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        quiet_lightning()
        if self.spawned:  # else the process is the CLI's (which set it already) or a caller's (process/allocator.py)
            keep_freed_memory()
        set_deterministic(self.deterministic)
        set_cuda_math(self.tf32, self.cudnn_benchmark)
        if self.threads:
            torch.set_num_threads(self.threads)
