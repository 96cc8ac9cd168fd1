"""A rank that dies or stalls ends the whole job within a minute, with a sentence naming the rank and what it did.

A rank that dies outright (`kill -9`, out of memory) is seen at once by the launcher's join, which stops the others
(SIGTERM, SIGKILL 30 s later) — no rank is left behind. A rank that hangs alive is ended by hslite's stall watch
(`stall_watch.py`: a heartbeat per rank, read by the spawning process) after `parallel.deadlines.stall` seconds, and
then the same happens. The collective deadline (`deadlines.py`) is the last resort: minutes, because on GPUs it is
NCCL's watchdog, which aborts every rank. Barriers, which end the phases where one rank works alone, are fences over
gloo with a deadline of their own. And each rank writes what it is doing (`RankActivity`, a small JSON file per rank,
at most once a second), so that `rank_failure` can say which rank failed, how, and where.
Each spawned rank's stderr goes to `ranks/rank<r>.log` in the run folder: when one rank dies the others' collectives
fail with tracebacks that say nothing the one sentence does not, and they stay there for a bug report.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from hslite.errors import HSLiteError
from hslite.parallel.deadlines import Deadlines
from hslite.parallel.ranks.stall_watch import Heartbeat, StallWatch, same_job_here, stalled_path

_EVERY_SECONDS = 1.0


class RankFailed(HSLiteError):
    """A rank of a multi-process run died, stalled or raised; the others were stopped."""


class RankActivity(pl.Callback):
    """Each rank keeps `<folder>/rank<r>.json` saying what it is doing, for the message when a rank fails."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._written = 0.0
        self._heartbeat: Heartbeat | None = None

    def _write(self, trainer: pl.Trainer, doing: str, force: bool = True) -> None:
        now = time.time()
        if not force and now - self._written < _EVERY_SECONDS:
            return
        self._written = now
        path = self.folder / f"rank{trainer.global_rank}.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        where = {"node": trainer.node_rank, "host": socket.gethostname()}  # a launched job's ranks are on many nodes
        tmp.write_text(json.dumps({"doing": doing, "at": now, "pid": os.getpid(), **where}))
        os.replace(tmp, path)  # the parent never reads half a file

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        if multiprocessing.parent_process() is not None:  # a spawned rank, not the process the user started
            self.folder.mkdir(parents=True, exist_ok=True)
            log = os.open(self.folder / f"rank{trainer.global_rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            sys.stderr.flush()
            os.dup2(log, 2)  # the fd, not only sys.stderr: C++ (gloo) and the launcher's own tracebacks go there too
            os.close(log)
        self._write(trainer, "setting up")
        self._heartbeat = Heartbeat(self.folder, trainer.global_rank)
        self._heartbeat.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

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


def rank_failure(
    error: BaseException, trainer: pl.Trainer, folder: Path, deadlines: Deadlines, stalled: dict[int, float]
) -> RankFailed | None:
    """The sentence for a spawned rank's failure (death, stall, exception), or None for any other error.

    `stalled`: the ranks the stall watch ended, with their seconds of silence; they are the culprits. Otherwise who
    stalled is read from how the ranks ended (the collective deadline passed). Over gloo the ranks that waited for a
    stalled peer raise a timeout (ProcessRaisedException) and the launcher stops the rest: SIGTERM, then SIGKILL 30 s
    later for a rank that does not answer, the stalled one. Over NCCL no exception is raised: its watchdog aborts the
    ranks that waited (SIGABRT, "Watchdog caught collective operation timeout" in their log), so the rank that ended
    first is a waiter, not the culprit; the stalled rank is one that was not aborted (killed by the launcher, or
    stopped by its SIGTERM).
    """
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    if not isinstance(error, (ProcessExitedException, ProcessRaisedException)):
        return None
    processes = getattr(trainer.strategy.launcher, "procs", None) or []
    codes = [p.exitcode for p in processes]
    first = int(getattr(error, "error_index", 0))
    wait = f"waited {deadlines.collective:g} s (parallel.deadlines.collective) for it in a collective"
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGTERM]
    if stalled:
        rank = min(stalled)
        how = (
            f"stopped responding: no heartbeat for {stalled[rank]:.0f} s (parallel.deadlines.stall="
            f"{deadlines.stall:g}), so hslite ended it"
        )
    elif _watchdog_aborted(first, codes, folder):
        waiters = [r for r, c in enumerate(codes) if c == -signal.SIGABRT]
        others = [r for r in range(len(codes)) if r not in waiters]
        rank = ([r for r in others if codes[r] == -signal.SIGKILL] or others or [first])[0]
        how = (
            f"stopped responding: rank {first} {wait} (NCCL's watchdog aborted the ranks that waited)"
            if rank not in waiters
            else "and every other rank timed out waiting in a collective (NCCL's watchdog aborted them all): the ranks "
            "issued different collectives, or a collective ran longer than the deadline"
        )
    elif isinstance(error, ProcessRaisedException) and _timed_out(error):
        silent = [r for r in killed if r != first] or [r for r in range(len(codes)) if r != first]
        rank = silent[0] if silent else first
        how = f"stopped responding: rank {first} {wait}"
    elif isinstance(error, ProcessRaisedException):
        rank = first
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        how = f"raised {lines[-1]}" if lines else "raised an error"
    else:
        rank = first if first in killed else (killed[0] if killed else first)  # the first to end by a signal died
        code = codes[rank] if rank < len(codes) else None
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
    doing = _activities(folder)
    where = f" while {doing[rank]}" if rank in doing else ""
    others_doing = "; ".join(f"rank {r} last: {d}" for r, d in sorted(doing.items()) if r != rank)
    return RankFailed(
        f"rank {rank} {how}{where}; the job was stopped and no rank is left running"
        + (f" ({others_doing})" if others_doing else "")
        + ". Its folder is kept (ending in .failed); continue it with the same command and resume=last."
    )


def launched_failure(error: BaseException, rank: int, folder: Path, deadlines: Deadlines) -> RankFailed | None:
    """The sentence for a launched job's rank whose collective failed because another rank or node went away.

    No launcher process of hslite's sees the ranks end here (torchrun's agents and srun do, node by node), so the
    rank that failed is read from the activity files: a rank a stall watch ended (`rank<r>.stalled`), else the other
    rank whose last sign of life is the oldest. Every surviving rank says it, raises, and its launcher ends the ranks
    left on its node.
    """
    import torch.distributed as dist

    text = str(error)
    if not isinstance(error, dist.DistError) and not _GLOO_ERROR.search(text):
        return None
    seen = _activity_entries(folder)
    others = sorted((entry["at"], r) for r, entry in seen.items() if r != rank)
    if not others:
        return None
    ended = sorted(r for r in seen if r != rank and stalled_path(folder, r).is_file())
    gone = ended[0] if ended else others[0][1]
    entry, me = seen[gone], seen.get(rank, {})
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    # gloo's "[file.cc:553] Connection closed by peer [host]:port. This is typically ..." -> its first sentence
    reason = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1]).split(". ")[0] if lines else type(error).__name__
    how = "stopped answering"
    if ended:
        silent = json.loads(stalled_path(folder, gone).read_text())["silent_seconds"]
        how = (
            f"stopped responding: no heartbeat for {silent:.0f} s (parallel.deadlines.stall={deadlines.stall:g}), so "
            "hslite ended it"
        )
    return RankFailed(
        f"rank {gone} on node {entry.get('node', '?')} ({entry.get('host', '?')}) {how}; its last sign "
        f"was {entry['doing']} ({time.time() - entry['at']:.0f} s ago), and rank {rank} on node {me.get('node', '?')} "
        f"saw its collective fail ({reason}). The launcher ends the ranks left "
        "on every node; the folder is kept (ending in .failed): continue it with the same command and resume=last."
    )


# gloo's failures reach Python as a plain RuntimeError that starts with the gloo source file it came from
# ("[.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer ..."); NCCL's are DistErrors.
_GLOO_ERROR = re.compile(r"\[[^\]]*/gloo/[^\]]*\.cc:\d+\]")


# What NCCL's watchdog logs before it aborts a rank whose collective passed the process group's timeout.
_WATCHDOG_TIMEOUT = "Watchdog caught collective operation timeout"


def _watchdog_aborted(first: int, codes: list[int | None], folder: Path) -> bool:
    """Whether the first rank to end was aborted by NCCL's watchdog for waiting too long, not crashed on its own.

    Its log says so; without one, a peer that had to be SIGKILLed (it answered no SIGTERM: it was stalled) says so.
    A rank that crashed with SIGABRT by itself leaves its peers to the launcher's SIGTERM, which they answer.
    """
    if first >= len(codes) or codes[first] != -signal.SIGABRT:
        return False
    try:
        if _WATCHDOG_TIMEOUT in (folder / f"rank{first}.log").read_text(errors="replace"):
            return True
    except OSError:
        pass
    return any(code == -signal.SIGKILL for rank, code in enumerate(codes) if rank != first)


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _activities(folder: Path) -> dict[int, str]:
    return {r: f"{e['doing']} ({time.time() - e['at']:.0f} s ago)" for r, e in _activity_entries(folder).items()}


def _activity_entries(folder: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for path in folder.glob("rank*.json"):
        try:
            entry = json.loads(path.read_text())
            if {"doing", "at"} <= entry.keys():
                out[int(path.stem.removeprefix("rank"))] = entry
        except (OSError, ValueError):
            continue
    return out


@contextmanager
def watched_ranks(trainer: pl.Trainer, folder: Path, deadlines: Deadlines, job: Any) -> Iterator[None]:
    """Run a fit of `trainer`'s ranks under the stall watch, and turn a rank's failure into its one sentence.

    `folder`: the ranks' activity folder; `job`: the launched job this process is a rank of, or None when the fit
    spawns its ranks (they are watched from here), else every launched rank watches its machine's others.
    """
    if trainer.world_size == 1:
        watch: Any = nullcontext(None)
    elif job is None:
        watch = StallWatch(folder, deadlines.stall)
    else:
        watch = StallWatch(folder, deadlines.stall, may_end=same_job_here, skip=job.global_rank)
    with watch as watching:
        try:
            yield
        except Exception as err:
            failed = (
                rank_failure(err, trainer, folder, deadlines, watching.stalled if watching else {})
                if job is None
                else launched_failure(err, job.global_rank, folder, deadlines)
            )
            if failed is None:
                raise
            raise failed from None
