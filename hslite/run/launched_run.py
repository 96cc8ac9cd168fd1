"""A fit whose ranks a launcher started (`parallel/launched.py`): what global rank 0 keeps and the others are handed.

Every rank loads the data, trains and refits; global rank 0 alone owns the run folder (it creates, locks and renames
it; the others write only their `ranks/` activity files into it), decides the pre-flight, evaluates, maps and writes
the reports. On several nodes the folder (output.root, and `resume=`) must be on a file system every node sees: the
README's "Several nodes" says so, and rank 0's node has everything a run keeps if it is not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from hslite.parallel.launched import LaunchedJob
from hslite.parallel.plan import Plan
from hslite.run.folder import RunFolder
from hslite.task import HSIClassifier


@dataclass
class FolderView:
    """Rank 0's run folder as another launched rank sees it: where it is, nothing to create or rename."""

    path: Path
    resumptions: list[dict[str, str]] = field(default_factory=list)


@contextmanager
def run_folder(parent: Path, resume: Path | None, job: LaunchedJob | None) -> Iterator[RunFolder | FolderView]:
    """The run's folder: a RunFolder on one box and on rank 0 of a launched job; a FolderView of it on the others."""
    if job is None:
        with RunFolder(parent, resume=resume) as run:
            yield run
    elif job.leader:
        with RunFolder(parent, resume=resume) as run:
            job.from_leader(lambda: run.path)
            yield run
    else:
        yield FolderView(job.from_leader(lambda: parent))  # the lambda runs on rank 0 only: this is rank 0's path


def whole_task(
    trainer: pl.Trainer, task: HSIClassifier, job: LaunchedJob | None, plan: Plan, fresh: Callable[[], HSIClassifier]
) -> HSIClassifier:
    """The trained model as rank 0 evaluates it alone (a collective on every launched rank; one box: `task`).

    Spawned ranks hand rank 0's weights back to a process that never trained (`fsdp._FullStateLauncher` gathers
    shards). Launched ranks trained in this process: under plain (or int8) DDP the module is whole and DDP's hooks sit
    on its wrapper, so it is evaluated as it is. FSDP's module holds shards, a channel-group forward exchanges tokens
    with the other ranks, and rotation leaves a subset of groups active: rank 0 then evaluates a `fresh` model
    holding the strategy's whole state dict (shards and channel-group replicas gathered).
    """
    if job is None or not (plan.fsdp or plan.chag_enabled or plan.rotation_enabled):
        return task
    state: dict[str, Any] = trainer.strategy.lightning_module_state_dict()  # whole on rank 0
    if not job.leader:
        return task
    whole = fresh()
    whole.load_state_dict(state)
    return whole
