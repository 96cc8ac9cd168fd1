"""The life of a run folder: `<stamp>.incomplete/` while it runs, `<stamp>/` when done, `<stamp>.failed/` otherwise.

A failed or interrupted run keeps everything it wrote (config, split, logs, last and best checkpoints) and gains
`error.txt`; nothing that did not finish ever looks finished. A run killed outright (`kill -9`) stays
`.incomplete`. SIGTERM is turned into an interruption while the run folder is open, so a scheduler's stop keeps the
evidence like Ctrl-C does. The signal is remembered, not inferred from the exception: a KeyboardInterrupt raised
inside a C++ callback (torch.save writing a checkpoint) surfaces as a RuntimeError, and is still an interruption.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from datetime import datetime
from pathlib import Path
from types import FrameType, TracebackType

from hslite.errors import HSLiteError


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
    """

    def __init__(self, parent: Path) -> None:
        self.parent = parent
        self.path = parent  # the folder as it is named now; set on entry
        self._stamp = ""
        self._signal: int | None = None
        self._previous_handlers: dict[int, object] = {}

    def __enter__(self) -> RunFolder:
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
        if threading.current_thread() is threading.main_thread():
            self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        raise KeyboardInterrupt  # unwinds Lightning and hslite alike, to __exit__

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        if error is None:
            self._rename(self._stamp)
            return
        self._rename(f"{self._stamp}.failed")
        # Lightning turns a KeyboardInterrupt into SystemExit(1); a KeyboardInterrupt raised by another thread's
        # code or the default handler (no signal of ours) still counts as Ctrl-C.
        interrupted = self._signal is not None or isinstance(error, (KeyboardInterrupt, SystemExit))
        signum = self._signal or signal.SIGINT
        if interrupted:
            summary = f"interrupted by {signal.Signals(signum).name}"
        else:
            summary = f"{type(error).__name__}: {error}"
        report = [summary, ""]
        if not interrupted and not isinstance(error, HSLiteError):  # a bug: keep the traceback for its report
            report += traceback.format_exception(kind, error, trace)
        (self.path / "error.txt").write_text("\n".join(report) + "\n")
        if interrupted:
            raise RunInterrupted(
                f"run {summary}; what it wrote so far (checkpoints, logs) is kept in {self.path}", signum
            ) from None
        print(f"hslite: the run failed; what it wrote is kept in {self.path} (see error.txt)", file=sys.stderr)

    def _rename(self, name: str) -> None:
        target = self.parent / name
        os.replace(self.path, target)
        self.path = target
