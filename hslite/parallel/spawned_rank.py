"""How a spawned rank ends once its work is handed back: at once, without the interpreter's exit."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def end_finished_rank(code: int = 0) -> NoReturn:
    """End a rank whose work and last collective are done, its output flushed, with `code`, without interpreter exit.

    A finished spawned rank aborted at interpreter exit in CI ("terminate called without an active exception",
    SIGABRT) once gloo's threads outlived the group's destroy (pytorch/pytorch#179291, strategies.DestroyedAtExit):
    FSDP's ranks, the ranks that measure links, a launched rank of channel groups (`hslite.cli.main` ends those).
    What the rank hands back must be written (a queue, a file) first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
