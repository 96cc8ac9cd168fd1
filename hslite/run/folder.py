"""The life of a run folder: `<stamp>.incomplete/` while it runs, `<stamp>/` when done, `<stamp>.failed/` otherwise.

A failed or interrupted run keeps everything it wrote (config, split, logs, last and best checkpoints) and gains
`error.txt`; nothing that did not finish ever looks finished. A run killed outright (`kill -9`) stays
`.incomplete`. SIGTERM is turned into an interruption while the run folder is open, so a scheduler's stop keeps the
evidence like Ctrl-C does. The signal is remembered, not inferred from the exception: a KeyboardInterrupt raised
inside a C++ callback (torch.save writing a checkpoint) surfaces as a RuntimeError, and is still an interruption.

A run holds an exclusive lock on `<folder>/.lock` while it lasts (the kernel drops it when the process dies, however
it dies), so `resume=` never continues a run that is still going. A resumed run reopens its folder as
`<stamp>.incomplete/` and appends to `resumed.json` (when, from which epoch, after what error).
A full disk, a read-only or unwritable folder ends the run with one sentence (`OutputError`), not a traceback.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from datetime import datetime
from pathlib import Path
from types import FrameType, TracebackType

from hslite.errors import HSLiteError


class OutputError(HSLiteError):
    """The run's output cannot be written: a full disk, a read-only filesystem, a folder without write permission."""


_WRITE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission is denied",
    errno.EPERM: "permission is denied",
}


def check_writable(folder: Path, need_bytes: int = 0) -> None:
    """Raise OutputError unless run folders can be made under `folder` with `need_bytes` free; creates nothing.

    The nearest existing folder on the way is tried with a temporary file, so a run refused later (a NO-GO) leaves no
    empty folder behind.
    """
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise OutputError(
            f"cannot write run folders under {folder}: {existing} is a file, not a folder. Set output.root elsewhere."
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".hslite-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = _WRITE_ERRNOS.get(err.errno or 0, err.strerror or str(err))
        raise OutputError(
            f"cannot write run folders under {folder}: {reason} (at {existing}). "
            "Set output.root to a folder you can write, or free it."
        ) from None
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise OutputError(
            f"{existing} has {free / 2**20:.0f} MiB free and the run's checkpoints need about {need_bytes / 2**20:.0f} "
            "MiB; free some space or set output.root elsewhere."
        )


def output_error(error: BaseException, folder: Path) -> OutputError | None:
    """The one-sentence OutputError for an OSError of writing (disk full, read-only, denied), else None."""
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in _WRITE_ERRNOS):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    where = getattr(cause, "filename", None) or folder
    reason = _WRITE_ERRNOS[cause.errno or 0]
    return OutputError(f"the run stopped writing {where}: {reason}. What it wrote so far is in {folder}.")


class RunInterrupted(HSLiteError):
    """The run was stopped by SIGINT (Ctrl-C) or SIGTERM; its folder was kept as `<stamp>.failed/`."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for a process ended by a signal


class RunFolder:
    """Context manager that creates `<parent>/<stamp>.incomplete/` and renames it once the block ends.

    with RunFolder(Path("runs") / "quickstart") as run:
        (run.path / "metrics.json").write_text(...)
    print(run.path)  # runs/quickstart/<stamp>, or <stamp>.failed after an exception

    `resume=FOLDER` reopens a stopped run's folder instead (`hslite.run.resume`).
    """

    def __init__(self, parent: Path, resume: Path | None = None) -> None:
        self.parent = resume.parent if resume is not None else parent
        self.path = self.parent  # the folder as it is named now; set on entry
        self.resumptions: list[dict[str, str]] = []  # this run's history of resumes (resumed.json)
        self._resume = resume
        self._stamp = ""
        self._signal: int | None = None
        self._previous_handlers: dict[int, object] = {}
        self._lock: int | None = None

    def __enter__(self) -> RunFolder:
        if self._resume is not None:
            self._reopen(self._resume)
        else:
            self._create()
        if threading.current_thread() is threading.main_thread():
            self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _create(self) -> None:
        self.parent.mkdir(parents=True, exist_ok=True)
        base = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        for attempt in range(1000):  # two runs started in the same microsecond get distinct folders
            self._stamp = base if attempt == 0 else f"{base}-{attempt}"
            try:
                (self.parent / f"{self._stamp}.incomplete").mkdir()
                break
            except FileExistsError:
                continue
        self.path = self.parent / f"{self._stamp}.incomplete"
        self._take_lock()

    def _reopen(self, folder: Path) -> None:
        self._stamp, _, state = folder.name.partition(".")
        if not state:
            raise HSLiteError(f"{folder} is a finished run; there is nothing to resume. Start a new run instead.")
        self.path = folder
        self._take_lock()
        self._rename(f"{self._stamp}.incomplete")
        history = self.path / "resumed.json"
        self.resumptions = json.loads(history.read_text()) if history.is_file() else []
        error = self.path / "error.txt"
        after = error.read_text().splitlines()[0] if error.is_file() else f"the run was {state}"
        self.resumptions.append({"at": datetime.now().isoformat(timespec="seconds"), "after": after})
        history.write_text(json.dumps(self.resumptions, indent=2) + "\n")
        error.unlink(missing_ok=True)

    def _take_lock(self) -> None:
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HSLiteError(
                f"{self.path} is in use by another hslite process (it holds the run's lock); wait for it to end."
            ) from None
        self._lock = fd

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        raise KeyboardInterrupt  # unwinds Lightning and hslite alike, to __exit__

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        try:
            self._finish(kind, error, trace)
        finally:
            if self._lock is not None:
                os.close(self._lock)  # releases the lock

    def _finish(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is None:
            self._rename(self._stamp)
            return
        self._rename(f"{self._stamp}.failed")
        # Lightning turns a KeyboardInterrupt into SystemExit(1); a KeyboardInterrupt raised by another thread's
        # code or the default handler (no signal of ours) still counts as Ctrl-C.
        interrupted = self._signal is not None or isinstance(error, (KeyboardInterrupt, SystemExit))
        unwritable = None if interrupted else output_error(error, self.path)
        signum = self._signal or signal.SIGINT
        if interrupted:
            summary = f"interrupted by {signal.Signals(signum).name}"
        else:
            summary = f"{type(error).__name__}: {unwritable or error}"
        report = [summary, ""]
        if not interrupted and unwritable is None and not isinstance(error, HSLiteError):  # a bug: keep the traceback
            report += traceback.format_exception(kind, error, trace)
        try:
            (self.path / "error.txt").write_text("\n".join(report) + "\n")
        except OSError:
            pass  # the disk that stopped the run may not take error.txt either; the message below still says why
        if interrupted:
            raise RunInterrupted(
                f"run {summary}; what it wrote so far (checkpoints, logs) is kept in {self.path}", signum
            ) from None
        if unwritable is not None:
            raise unwritable from None
        print(f"hslite: the run failed; what it wrote is kept in {self.path} (see error.txt)", file=sys.stderr)

    def _rename(self, name: str) -> None:
        target = self.parent / name
        os.replace(self.path, target)
        self.path = target
