"""A rank that dies or stalls ends the whole job within a minute, with a sentence naming the rank and what it did.

Two parts. Every collective has a deadline (`plan.PROCESS_GROUP_TIMEOUT`): a rank waiting on a
stalled peer raises instead of waiting torch's default 30 minutes, and Lightning's spawn launcher then stops the
other ranks (SIGTERM, SIGKILL 30 s later) — no rank is left behind. A rank that dies outright (`kill -9`, out of
memory) is seen at once by the launcher's join. And each rank writes what it is doing (`RankActivity`, a small
JSON file per rank, at most once a second), so that `rank_failure` can say which rank failed, how, and where.
Each spawned rank's stderr goes to `ranks/rank<r>.log` in the run folder: when one rank dies the others' collectives
fail with tracebacks that say nothing the one sentence does not, and they stay there for a bug report.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from hslite.errors import HSLiteError
from hslite.parallel.plan import PROCESS_GROUP_TIMEOUT

_EVERY_SECONDS = 1.0


class RankFailed(HSLiteError):
    """A rank of a multi-process run died, stalled or raised; the others were stopped."""


class RankActivity(pl.Callback):
    """Each rank keeps `<folder>/rank<r>.json` saying what it is doing, for the message when a rank fails."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._written = 0.0

    def _write(self, trainer: pl.Trainer, doing: str, force: bool = True) -> None:
        now = time.time()
        if not force and now - self._written < _EVERY_SECONDS:
            return
        self._written = now
        path = self.folder / f"rank{trainer.global_rank}.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"doing": doing, "at": now, "pid": os.getpid()}))
        os.replace(tmp, path)  # the parent never reads half a file

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        if multiprocessing.parent_process() is not None:  # a spawned rank, not the process the user started
            self.folder.mkdir(parents=True, exist_ok=True)
            log = os.open(self.folder / f"rank{trainer.global_rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            sys.stderr.flush()
            os.dup2(log, 2)  # the fd, not only sys.stderr: C++ (gloo) and the launcher's own tracebacks go there too
            os.close(log)
        self._write(trainer, "setting up")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self._write(trainer, f"training epoch {trainer.current_epoch + 1}")

    def on_train_batch_start(  # noqa: D102
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._write(trainer, f"training epoch {trainer.current_epoch + 1}, batch {batch_idx + 1}", force=False)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self._write(trainer, f"validating after epoch {trainer.current_epoch + 1}")

    def on_save_checkpoint(  # noqa: D102
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._write(trainer, f"saving a checkpoint after epoch {trainer.current_epoch + 1}")


def rank_failure(error: BaseException, trainer: pl.Trainer, folder: Path) -> RankFailed | None:
    """The sentence for a spawned rank's failure (death, stall, exception), or None for any other error."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    if not isinstance(error, (ProcessExitedException, ProcessRaisedException)):
        return None
    processes = getattr(trainer.strategy.launcher, "procs", None) or []
    codes = [p.exitcode for p in processes]
    first = int(getattr(error, "error_index", 0))
    # The launcher stops the other ranks with SIGTERM (Lightning's handler then exits with 1) and kills those that
    # do not end within 30 s: a stalled rank ends by SIGKILL, a dead one by whatever killed it.
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGTERM]
    if isinstance(error, ProcessRaisedException) and _timed_out(error):
        stalled = [r for r in killed if r != first] or [r for r in range(len(codes)) if r != first]
        rank = stalled[0] if stalled else first
        how = f"stopped responding: rank {first} waited {PROCESS_GROUP_TIMEOUT.seconds} s for it in a collective"
    elif isinstance(error, ProcessRaisedException):
        rank = first
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        how = f"raised {lines[-1]}" if lines else "raised an error"
    else:
        rank = killed[0] if killed else first
        code = codes[rank] if rank < len(codes) else None
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
    doing = _activities(folder)
    where = f" while {doing[rank]}" if rank in doing else ""
    others = "; ".join(f"rank {r} last: {d}" for r, d in sorted(doing.items()) if r != rank)
    return RankFailed(
        f"rank {rank} {how}{where}; the job was stopped and no rank is left running"
        + (f" ({others})" if others else "")
        + ". Its folder is kept (ending in .failed); continue it with the same command and resume=last."
    )


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _activities(folder: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for path in folder.glob("rank*.json"):
        try:
            entry = json.loads(path.read_text())
            out[int(path.stem.removeprefix("rank"))] = f"{entry['doing']} ({time.time() - entry['at']:.0f} s ago)"
        except (OSError, ValueError, KeyError):
            continue
    return out
