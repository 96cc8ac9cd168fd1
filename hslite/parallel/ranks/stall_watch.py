"""hslite's own watch for a rank that hangs alive: a heartbeat each rank writes, read by the process that spawned them.

A rank that dies is seen at once by the launcher (its exit). A rank that stops without dying (SIGSTOP, a GIL held by
a stuck extension, a machine swapping) is what a collective deadline used to catch; on GPUs that deadline is NCCL's
watchdog, which aborts every rank (SIGABRT) and must therefore be minutes (`deadlines.py`). So each rank runs a
daemon thread that rewrites `rank<r>.beat` every second, and the spawning process ends a rank whose beat has not
changed for `parallel.deadlines.stall` seconds (SIGKILL, which a stopped process cannot ignore); the launcher then
stops the others as for any rank that died, and `rank_watch.rank_failure` names the rank and why. A rank working
alone (rank 0 writing a checkpoint) keeps beating: only a frozen process goes quiet. Under torchrun or srun no
process of hslite's spawned the ranks: there every rank watches the others on its own machine (`same_job_here`), and
leaves `rank<r>.stalled` for the survivors' sentence; a rank alone on its node is left to the collective deadline.

The watcher measures silence on its own monotonic clock from when it last saw a beat change, so clocks of other
machines and a network file system's timestamps do not enter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

_EVERY_SECONDS = 1.0


def beat_path(folder: Path, rank: int) -> Path:
    """Where rank `rank` writes its heartbeat."""
    return folder / f"rank{rank}.beat"


class Heartbeat:
    """A daemon thread rewriting `<folder>/rank<r>.beat` ("<pid> <count> <host>") every second until `stop`."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = beat_path(folder, rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hslite-heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        """Write the first beat now, then one a second."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and remove the file: a rank that ended its work is not a stalled one."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        count = 0
        tmp, host = self.path.with_suffix(".beat-tmp"), socket.gethostname()
        while not self._stop.is_set():
            count += 1
            try:
                tmp.write_text(f"{os.getpid()} {count} {host}")
                os.replace(tmp, self.path)  # the watcher never reads half a beat
            except OSError:
                pass  # a full or vanished folder must not end the rank; the watcher sees the silence
            self._stop.wait(_EVERY_SECONDS)


class StallWatch:
    """Ends (SIGKILL) a rank whose beat has not changed for `stall_seconds`, when `may_end(pid, host)` allows it.

    In the spawning process `may_end` is `is_live_child`; in a launched rank, `same_job_here` and `skip` its own rank.
    `stalled` maps each rank it ended to the seconds of silence it saw, for the failure's sentence; `rank<r>.stalled`
    says the same to the other processes of the job.
    """

    def __init__(
        self,
        folder: Path,
        stall_seconds: float,
        may_end: Callable[[int, str], bool] | None = None,
        skip: int | None = None,
    ) -> None:
        self.folder, self.stall_seconds, self.skip = folder, stall_seconds, skip
        self.may_end = may_end or is_live_child
        self.stalled: dict[int, float] = {}
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (last beat read, when it changed, monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hslite-stall-watch", daemon=True)

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(_EVERY_SECONDS):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One look at every beat file: note the ones that changed, end the ranks silent for too long."""
        for path in self.folder.glob("rank*.beat"):
            rank = int(path.stem.removeprefix("rank"))
            if rank == self.skip:
                continue
            try:
                beat = path.read_text()
            except OSError:
                continue  # removed by a rank that finished
            last, since = self._seen.get(rank, ("", now))
            if beat != last:
                self._seen[rank] = (beat, now)
            elif rank not in self.stalled and now - since > self.stall_seconds:
                pid, _, host = beat.split(" ", 2)
                if self.may_end(int(pid), host):
                    os.kill(int(pid), signal.SIGKILL)
                    self.stalled[rank] = now - since
                    stalled_path(self.folder, rank).write_text(json.dumps({"silent_seconds": now - since}))


def stalled_path(folder: Path, rank: int) -> Path:
    """The note a watch leaves when it ended rank `rank`."""
    return folder / f"rank{rank}.stalled"


def is_live_child(pid: int, host: str = "") -> bool:
    """Whether `pid` is a child of this process that has not ended (a stale beat may name a reused pid)."""
    status = _status(pid)
    return status is not None and status[1] == os.getpid() and status[0] != "Z"


def same_job_here(pid: int, host: str) -> bool:
    """Whether `pid` is a live rank of this launched job on this machine (started with this process's job identity)."""
    status = _status(pid)
    if host != socket.gethostname() or status is None or status[0] == "Z":
        return False
    ours = {line for line in _start_environment(os.getpid()) if line.split(b"=", 1)[0] in _JOB_IDENTITY}
    return bool(ours) and ours <= _start_environment(pid)


# What torchrun and srun give every rank of one job (as the launcher started it: /proc shows the start environment).
_JOB_IDENTITY = {b"MASTER_ADDR", b"MASTER_PORT", b"TORCHELASTIC_RUN_ID", b"SLURM_JOB_ID", b"SLURM_STEP_ID"}


def _start_environment(pid: int) -> set[bytes]:
    try:
        return set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return set()


def _status(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, or None when it is gone."""
    try:
        state, parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, IndexError, ValueError):
        return None
    return state, int(parent)
