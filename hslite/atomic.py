"""Write a file so that a crash or a kill never leaves half of it under its name.

The bytes go to a temporary file beside the target, are fsynced, renamed over the target and the folder is fsynced,
so the previous file stays readable until the new one is whole.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(f)` on a temporary file in `path`'s folder, then fsync and rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; the file should read like any other the user writes
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


_PROC_STATUS = Path("/proc/self/status")


def file_mode() -> int:
    """0666 less the process umask: the mode `open(path, "w")` would have given the file."""
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read where Linux shows it (4.7 and later), so no other thread sees it change.

    Elsewhere it can only be read by setting it: to 077 for that moment, so a file another thread creates meanwhile is
    private rather than open to everyone.
    """
    try:
        status = _PROC_STATUS.read_text()
    except OSError:
        status = ""
    for line in status.splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
